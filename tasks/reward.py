"""reward: score the chosen batch with the rule reward (by import path), keep raw values, build the
train batch with group-normalised advantages."""
from __future__ import annotations

import math
from numbers import Real

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from rollout.sample import Sample, Status, convert_samples_to_train_data
from rollout.sft import is_sft_batch
from tasks.batching import TrainBatch
from tasks.grpo_loss import group_advantages


class RewardError(ValueError):
    """A reward function raised or returned something that is not a finite number."""


def decode_responses(samples: list[Sample], tokenizer, stop_token_ids) -> None:
    """Fill sample.response with the decoded text (a trailing stop token is not part of the text)."""
    stops = set(stop_token_ids)
    texts = batch_decode([s.response_tokens[:-1] if s.response_tokens and s.response_tokens[-1] in stops
                          else s.response_tokens for s in samples], tokenizer)
    for s, text in zip(samples, texts):
        s.response = text


def batch_decode(ids: list[list[int]], tokenizer) -> list[str]:
    """tokenizer.batch_decode(ids, skip_special_tokens=True). A fast tokenizer without space clean-up decodes
    to the same texts in one call to its Rust backend (HF's own loop costs ~15 us per sequence in Python)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    return backend.decode_batch(ids, skip_special_tokens=True)


def score_samples(samples: list[Sample], reward_fn, fn_path: str) -> np.ndarray:
    """Rule reward per sample -> float[len(samples)]; NaN, a non-number or an exception names the sample."""
    if getattr(reward_fn, "batched", False):
        values = _call(reward_fn, fn_path, "the batch", [s.response for s in samples], [s.label for s in samples],
                       samples=samples)
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(samples):
            raise RewardError(f"reward function {fn_path!r} (batched) must return {len(samples)} numbers")
    else:
        values = [_call(reward_fn, fn_path, _name(s), s.response, s.label, sample=s) for s in samples]
    out = np.empty(len(samples), dtype=np.float64)
    for i, (s, v) in enumerate(zip(samples, values)):
        if isinstance(v, bool) or not isinstance(v, (Real, np.floating, np.integer)) or not math.isfinite(float(v)):
            raise RewardError(f"reward function {fn_path!r} returned {v!r} for {_name(s)}; "
                              f"it must return a finite number")
        out[i] = float(v)
    return out


def _name(s: Sample) -> str:
    return f"sample {s.index} (group {s.group_index}, prompt {s.prompt[:40]!r})"


def _call(fn, fn_path, what, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # a user function: report which sample and which function
        raise RewardError(f"reward function {fn_path!r} raised on {what}: {type(err).__name__}: {err}") from err


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
