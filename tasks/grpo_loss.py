"""GRPO loss pieces as pure functions: advantages, KL estimators, clipped policy loss, off-policy
corrections against the engine's rollout logprobs (grpo.off_policy), loss aggregation. Shapes: G groups of
n samples; B samples x T response tokens (right-padded, with a 0/1 `mask` marking the tokens that count).

Everything here is stateless and unit-tested against hand-computed values; the learner composes it.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch

KLEstimator = Literal["k1", "k3", "low_var_kl"]
LossAgg = Literal["token_mean", "seq_mean"]
OffPolicy = Literal["none", "tis", "masked_is", "seq_reject", "decoupled"]


def group_advantages(rewards, eps: float = 1e-6, scale_by_std: bool = True) -> np.ndarray:
    """advantages(rewards[G, n]) -> [G, n]: (r - group mean) / (group std + eps).

    std is the unbiased (n - 1) sample std, as in DeepSeekMath's GRPO and verl. A group whose rewards
    are all equal has no signal: its advantages are exactly 0 (no division by a zero std).
    `scale_by_std=False` gives Dr. GRPO's mean-only centring.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, n] with n >= 2 (GRPO needs a group); got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        bad = np.argwhere(~np.isfinite(r))[0]
        raise ValueError(f"reward of group {bad[0]} sample {bad[1]} is {r[tuple(bad)]}; rewards must be finite")
    centred = r - r.mean(axis=1, keepdims=True)
    if not scale_by_std:
        return centred.astype(np.float32)
    std = r.std(axis=1, ddof=1, keepdims=True)
    flat = np.isclose(std, 0.0, atol=1e-12)
    adv = np.where(flat, 0.0, centred / np.where(flat, 1.0, std + eps))
    return adv.astype(np.float32)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled tokens: ([B, T], [B, T]) -> [B, T].

    k1 = logp - ref (unbiased, high variance, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, >= 0, Schulman's estimator); low_var_kl = k3 with the log-ratio clamped to [-20, 20] and
    the result to [-10, 10] (verl's numerically safe k3).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    if estimator == "low_var_kl":
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"grpo.kl_estimator must be one of k1, k3, low_var_kl; got {estimator!r}")


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling weights ([B, T], [B, T]) -> [B, T] = min(exp(old - rollout), cap).

    Corrects for tokens sampled by the engine (possibly older weights, different kernels) while the loss
    is taken against the learner's old policy. Detached: it scales the gradient, it is not optimised.
    """
    if cap <= 0:
        raise ValueError(f"grpo.tis_cap must be > 0; got {cap}")
    return torch.clamp(torch.exp(old_logprobs.detach() - rollout_logprobs.detach()), max=cap)


def masked_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling ([B, T] x 3) -> (weights[B, T], keep[B, T] as 0/1 float).

    ratio = exp(old - rollout); a token whose ratio exceeds `cap` is dropped (keep = 0), so it leaves the
    loss and its denominator (pass `keep` as the aggregation mask); kept tokens are weighted by their
    untruncated ratio. verl's rollout IS "mask" mode and slime's MIS do the same (upper bound only here).
    """
    if cap <= 0:
        raise ValueError(f"grpo.tis_cap must be > 0; got {cap}")
    ratio = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    keep = mask.to(ratio.dtype) * (ratio <= cap).to(ratio.dtype)
    return torch.where(keep > 0, ratio, torch.zeros_like(ratio)), keep  # ratio x 0 would be NaN where exp overflowed


def geometric_mean_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """Per-sample geometric mean of exp(old - rollout) over masked tokens: ([B, T] x 3) -> [B] (1 when empty).

    exp(mean log-ratio) does not grow with the length the way the sequence product does.
    """
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs.detach() - rollout_logprobs.detach()) * mask
    return torch.exp(log_ratio.sum(dim=1) / torch.clamp(mask.sum(dim=1), min=1.0))


def sequence_rejection_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                            low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level rejection by the geometric-mean ratio ([B, T] x 3) -> (keep[B, T], rejected[B] 0/1).

    A sample whose geometric_mean_ratio lies outside [low, high] is dropped whole (every token's keep = 0,
    so it leaves the loss and its denominators); accepted samples keep their mask and get no IS weight
    (verl's "geometric" rejection sampling without token weights).
    """
    if not 0 < low <= 1.0 <= high:
        raise ValueError(f"grpo.seq_reject_low/high must satisfy 0 < low <= 1 <= high; got {low}, {high}")
    mask = mask.to(old_logprobs.dtype)
    ratio = geometric_mean_ratio(old_logprobs, rollout_logprobs, mask)
    rejected = ((ratio < low) | (ratio > high)) & (mask.sum(dim=1) > 0)
    return mask * (~rejected).to(mask.dtype).unsqueeze(1), rejected.to(mask.dtype)


def behaviour_weights(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Decoupled PPO's behaviour importance weight ([B, T], [B, T]) -> [B, T] = exp(prox - behav), and 0 where
    it exceeds `cap`: such tokens add nothing but stay in the denominator (AReaL's behav_imp_weight_cap
    filters the same way rather than truncating)."""
    if cap <= 0:
        raise ValueError(f"grpo.tis_cap must be > 0; got {cap}")
    weight = torch.exp(prox_logprobs.detach() - behav_logprobs.detach())
    return torch.where(weight <= cap, weight, torch.zeros_like(weight))


def off_policy_correction(mode: OffPolicy, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                          mask: torch.Tensor, cap: float, low: float = 0.8,
                          high: float = 1.25) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.off_policy as (weights[B, T], keep[B, T]) from ([B, T] x 3): the per-token loss of
    clipped_policy_loss(logp, old, A) is multiplied by `weights` and aggregated over `keep` (mask minus what
    the correction drops). Mode "decoupled" with old = the learner's recomputed (proximal) logprobs is decoupled
    PPO (Hilton et al. 2021; AReaL): the clipped surrogate of pi / pi_prox times behaviour_weights(prox, rollout)."""
    mask = mask.to(old_logprobs.dtype)
    if mode == "none":
        return torch.ones_like(mask), mask
    if mode == "tis":
        return tis_weights(old_logprobs, rollout_logprobs, cap), mask
    if mode == "masked_is":
        return masked_is_weights(old_logprobs, rollout_logprobs, mask, cap)
    if mode == "seq_reject":
        keep, _ = sequence_rejection_mask(old_logprobs, rollout_logprobs, mask, low, high)
        return torch.ones_like(mask), keep
    if mode == "decoupled":
        return behaviour_weights(old_logprobs, rollout_logprobs, cap), mask
    raise ValueError(f"grpo.off_policy must be one of none, tis, masked_is, seq_reject, decoupled; got {mode!r}")


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clip_eps: float, clip_eps_high: float | None = None,
                        dual_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clipped surrogate per token -> (loss[B, T], clipped[B, T] as 0/1 float).

    ratio = exp(logp - old); loss = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high)).
    `advantages` broadcasts ([B, 1] for GRPO's per-sample advantage). clip_eps_high (DAPO's
    clip-higher) defaults to clip_eps. dual_clip_c (> 1, Ye et al. 2020) caps the loss of negative
    advantage tokens at -A * c so a huge ratio cannot blow it up.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1; got {dual_clip_c}")
        capped = torch.minimum(loss, -advantages * dual_clip_c)
        negative = (advantages < 0).expand_as(loss)
        was_clipped = torch.where(negative & (capped < loss), torch.ones_like(was_clipped), was_clipped)
        loss = torch.where(negative, capped, loss)
    return loss, was_clipped


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: LossAgg,
              total_tokens: float | None = None, total_seqs: float | None = None) -> torch.Tensor:
    """Masked reduction [B, T] -> scalar.

    token_mean: sum(values * mask) / total_tokens (every token weighs the same);
    seq_mean: sum over samples of (each sample's token mean) / total_seqs (every sample weighs the same).
    With micro-batches, pass the whole batch's totals so the micro-batch losses add up to the batch loss;
    they default to this micro-batch's own. Samples with no masked token contribute 0.
    """
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        denom = mask.sum() if total_tokens is None else torch.tensor(float(total_tokens), dtype=values.dtype)
        return (values * mask).sum() / torch.clamp(denom, min=1.0)
    if mode == "seq_mean":
        per_seq = (values * mask).sum(dim=1) / torch.clamp(mask.sum(dim=1), min=1.0)
        if total_seqs is None:
            total_seqs = float((mask.sum(dim=1) > 0).sum())
        return per_seq.sum() / max(float(total_seqs), 1.0)
    raise ValueError(f"grpo.loss_agg must be token_mean or seq_mean; got {mode!r}")
