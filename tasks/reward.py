"""reward: decode the batch's responses, score them with the rule reward (by import path), and hand on the
batch with group-normalised advantages (in Ray's object store, for the logprob and update steps)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from ..rollout.batch import RolloutBatch, label_of_rows, metadata_of_rows
from ..rollout.scoring.rule_reward import batch_decode, score_responses, wants_samples
from .grpo_loss import group_advantages
from .results import Rollout, Scored

REWARD_KEYWORDS = ("sample", "samples", "metadata")  # passed only to reward functions that name them

__all__ = ["REWARD_KEYWORDS", "RewardSetup", "build_advantages", "compute_reward", "response_texts", "reward_metrics",
           "rule_rewards", "sample_rewards", "score_batch"]


@dataclass(frozen=True)
class RewardSetup:
    """What scoring needs from the run: decoding, the rule reward and its weight, prompt texts for messages."""
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    reward_fn: Callable
    reward_fn_path: str
    rule_weight: float = 1.0
    exact_match: Callable | None = None       # the built-in task's exact-match check (a reported metric)
    prompt_texts: Callable | None = None      # group stream ids[G] -> prompt texts[G]
    concurrency: int = 32                     # grpo.reward_concurrency: async reward calls at once
    timeout_s: float | None = None            # grpo.reward_timeout_s: the most one reward call may take
    reward_models: Any = None                 # spillover.rollout.scoring.reward_models.RewardModels (grpo.reward_models), or None
    keep_sample_rewards: bool = False         # samples a rollout function scored keep their reward (no reward
                                              # function configured: grpo.reward_function_path left at its default)


def response_texts(batch: RolloutBatch, tokenizer, stop_token_ids) -> list[str]:
    """Decoded response per row; a trailing stop token is not part of the text."""
    stops = set(int(t) for t in stop_token_ids)
    ids = [r[:-1] if r and r[-1] in stops else r for r in batch.response_lists()]
    return batch_decode(ids, tokenizer)


def score_batch(batch: RolloutBatch, texts: list[str], setup: RewardSetup) -> np.ndarray:
    """Raw rule reward per row -> float64[R]; the function gets Sample objects only if it names `sample(s)`."""
    n = batch.n
    prompts = _group_prompts(batch, setup)
    samples = None
    if wants_samples(setup.reward_fn):
        samples = [s for g in batch.sample_groups() for s in g]
        for i, (s, text) in enumerate(zip(samples, texts)):
            s.response, s.prompt = text, s.prompt or prompts[i // n]

    def describe(i: int) -> str:
        group = int(batch.group_ids[i // n])
        return f"sample {group * n + i % n} (group {group}, prompt {prompts[i // n][:40]!r})"

    return score_responses(texts, label_of_rows(batch), setup.reward_fn, setup.reward_fn_path, describe, samples,
                           metadata_of_rows(batch), setup.concurrency, setup.timeout_s)


def _group_prompts(batch: RolloutBatch, setup: RewardSetup) -> list[str]:
    if batch.samples is not None:
        return [g[0].prompt for g in batch.samples]
    if setup.prompt_texts is not None:
        return list(setup.prompt_texts(batch.group_ids))
    return [""] * len(batch.group_ids)


def sample_rewards(batch: RolloutBatch) -> np.ndarray | None:
    """float64[R]: the rewards a custom rollout function set on its samples (NaN: not set, e.g. Sample.reward None);
    None for a batch not built from samples (the dock's)."""
    if batch.samples is None:
        return None
    return np.array([np.nan if s.reward is None else float(s.reward) for g in batch.samples for s in g])


def rule_rewards(batch: RolloutBatch, texts: list[str], setup: RewardSetup) -> np.ndarray:
    """float64[R]: rule_weight x the reward function's score; with keep_sample_rewards, a sample its rollout function
    scored keeps that reward instead (slime: samples that carry a reward are not scored again), and when every
    sample carries one the reward function is not called."""
    own = sample_rewards(batch) if setup.keep_sample_rewards else None
    if own is not None and np.isfinite(own).all():
        return own
    scored = setup.rule_weight * score_batch(batch, texts, setup)
    return scored if own is None else np.where(np.isfinite(own), own, scored)


def build_advantages(batch: RolloutBatch, rewards: np.ndarray) -> np.ndarray:
    """rewards[R] -> advantages[R]: group-normalised (GRPO), or 1 for every SFT sample (the NLL gradient at
    ratio 1, see rollout/builtin/sft.py)."""
    if batch.sft:
        return np.ones(len(batch), dtype=np.float32)
    return group_advantages(rewards.reshape(len(batch.group_ids), batch.n)).reshape(-1)


def reward_metrics(batch: RolloutBatch, rewards: np.ndarray, texts: list[str], exact) -> dict:
    lengths = batch.response_lengths
    out = {"response_length_p50": float(np.percentile(lengths, 50)) if len(lengths) else 0.0,
           "response_length_p90": float(np.percentile(lengths, 90)) if len(lengths) else 0.0,
           "response_length_max": int(lengths.max()) if len(lengths) else 0,
           "truncated_share": float(batch.truncated.mean()) if len(lengths) else 0.0}
    if batch.sft:
        return {**out, "sft_samples": len(batch)}
    out.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()))
    if exact is not None:
        out["exact_match"] = float(np.mean([bool(exact(t, label)) for t, label in zip(texts, label_of_rows(batch))]))
    return out


@task(name="compute_reward", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def compute_reward(rollout: Rollout, setup: RewardSetup) -> Scored:
    import ray

    batch = rollout.batch
    texts = response_texts(batch, setup.tokenizer, setup.stop_token_ids)
    rewards = np.zeros(len(batch)) if batch.sft else rule_rewards(batch, texts, setup)
    model_metrics = {}
    if setup.reward_models and not batch.sft:  # + sum of weight x reward model score, on prompt + response text
        prompts = _group_prompts(batch, setup)
        scores, model_metrics = setup.reward_models.score([prompts[i // batch.n] + t for i, t in enumerate(texts)])
        rewards = rewards + scores
    scored = batch.with_advantages(build_advantages(batch, rewards))
    versions = batch.weight_versions
    span = (int(versions.min()), int(versions.max())) if len(versions) else (0, 0)
    return Scored(metrics=reward_metrics(batch, rewards, texts, setup.exact_match) | model_metrics,
                  batch_ref=ray.put(scored),
                  token_versions=span, sft=batch.sft)
