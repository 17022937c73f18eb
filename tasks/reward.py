"""reward: score the chosen batch with the rule reward (by import path), keep raw values, build the
train batch with group-normalised advantages."""
from __future__ import annotations

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from rollout.sample import Sample, Status, convert_samples_to_train_data
from rollout.scoring import RewardError, batch_decode, decode_responses, score_samples  # noqa: F401
from rollout.sft import is_sft_batch
from tasks.batching import TrainBatch
from tasks.grpo_loss import group_advantages


def build_train_batch(groups: list[list[Sample]], rewards: np.ndarray) -> tuple[TrainBatch, np.ndarray]:
    """Samples with rewards -> TrainBatch with group-normalised advantages. rewards[G*n] -> adv[G, n]"""
    n = len(groups[0])
    flat = [s for g in groups for s in g]
    for s, r in zip(flat, rewards):
        s.reward = float(r)
    adv = group_advantages(rewards.reshape(len(groups), n))
    data = convert_samples_to_train_data(flat)
    batch = TrainBatch.from_train_data(data, adv.reshape(-1).tolist(), [s.rollout_logprobs for s in flat],
                                       [s.weight_versions for s in flat])
    return batch, adv


def build_sft_batch(groups: list[list[Sample]]) -> TrainBatch:
    """SFT samples -> TrainBatch with advantage 1 on every sample: at ratio 1 the clipped loss's gradient
    is the NLL gradient (rollout/sft.py). The learner must compute old logprobs (see needs_old_logprob_pass)."""
    flat = [s for g in groups for s in g]
    for s in flat:
        s.reward = 0.0
    data = convert_samples_to_train_data(flat)
    return TrainBatch.from_train_data(data, [1.0] * len(flat), [s.rollout_logprobs for s in flat],
                                      [s.weight_versions for s in flat])


def reward_metrics(groups: list[list[Sample]], rewards: np.ndarray, exact) -> dict:
    flat = [s for g in groups for s in g]
    lengths = np.array([s.response_length for s in flat])
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
           "response_length_p50": float(np.percentile(lengths, 50)),
           "response_length_p90": float(np.percentile(lengths, 90)),
           "response_length_max": int(lengths.max()),
           "truncated_share": float(np.mean([s.status == Status.TRUNCATED for s in flat]))}
    if exact is not None:
        out["exact_match"] = float(np.mean([bool(exact(s.response, s.label)) for s in flat]))
    return out


@task(name="compute_reward", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def compute_reward(run) -> dict:
    import ray

    it = run.current
    groups = it.samples
    flat = [s for g in groups for s in g]
    if is_sft_batch(groups):
        it.train_batch = build_sft_batch(groups)
        it.train_batch_ref = ray.put(it.train_batch)
        it.metrics.update({"reward_mean": 0.0, "sft_samples": len(flat)})
        return {"sft_samples": len(flat)}
    if run.controller.uses_dock:
        indices = run.cursor.dataset_indices(np.array([g[0].group_index for g in groups]))
        for group, idx in zip(groups, indices):
            for s in group:
                s.prompt = run.prompts.texts[idx]
    decode_responses(flat, run.tokenizer, run.stop_token_ids)
    raw = score_samples(flat, run.reward_fn, run.cfg.grpo.reward_function_path)
    rewards = run.cfg.grpo.rule_reward_weight * raw
    for s, v in zip(flat, raw):
        s.metadata["raw_reward"] = float(v)
    it.samples = groups
    it.train_batch, _ = build_train_batch(groups, rewards)
    it.train_batch_ref = ray.put(it.train_batch)
    metrics = reward_metrics(groups, rewards, getattr(run, "exact_match_fn", None))
    it.metrics.update(metrics)
    return metrics
