"""Off-policy metrics of one update: how stale the trained tokens are, how far the engine's sampling
distribution is from the learner's, and what grpo.off_policy dropped.

Shapes: one micro-batch of B samples x T response tokens (right-padded); `mask` marks the tokens that count
in the loss (the batch's loss mask); weight_versions is -1 where no policy made the token (padding, SFT
data), and such tokens never count here. Pure functions, plus `OffPolicyStats`, which adds them up over
the micro-batches of one update (`update` in tasks/learner/actor.py returns its `metrics()`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..grpo_loss import kl_penalty

# log-spaced bins of the IS weight exp(old - rollout), two per factor of 2 from 2^-4.25 to 2^4.25 (~1/19 ... 19),
# the middle one [2^-0.25, 2^0.25) centred on 1 (so on-policy rounding noise stays in one bin); weights beyond
# either end are counted in the end bins. Fixed, so the histograms of iterations line up.
IS_WEIGHT_BIN_EDGES: tuple[float, ...] = tuple(2.0 ** ((k + 0.5) / 2) for k in range(-9, 9))
IS_WEIGHT_QUANTILES = (50, 90, 99)
SCALAR_KEYS = ("token_staleness_max", "version_span_max", "is_weight_p50", "is_weight_p90", "is_weight_p99",
               "is_weight_max", "masked_token_share", "rejected_sequence_share", "logprob_mismatch_kl")


def _policy_tokens(weight_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: loss tokens that some policy version generated."""
    return (mask > 0) & (weight_versions >= 0)


def token_staleness(weight_versions: torch.Tensor, mask: torch.Tensor, current_version: int) -> torch.Tensor:
    """Versions between the update's weights and each token's: ([B, T] long, [B, T]) -> [B, T] long,
    current_version - weight_version on policy-generated loss tokens, 0 elsewhere."""
    tokens = _policy_tokens(weight_versions, mask)
    return torch.where(tokens, current_version - weight_versions, torch.zeros_like(weight_versions))


def version_spans(weight_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sample, newest minus oldest weight version among its loss tokens: [B, T] -> [B] long (0 if none).

    A partial rollout continued under new weights spans more than one version."""
    tokens = _policy_tokens(weight_versions, mask)
    big = torch.iinfo(weight_versions.dtype).max
    newest = torch.where(tokens, weight_versions, torch.full_like(weight_versions, -1)).max(dim=1).values
    oldest = torch.where(tokens, weight_versions, torch.full_like(weight_versions, big)).min(dim=1).values
    return torch.where(tokens.any(dim=1), newest - oldest, torch.zeros_like(newest))


def is_weight_quantiles(weights: np.ndarray) -> dict[str, float]:
    """IS weights of the trained tokens [K] -> {is_weight_p50, _p90, _p99, _max} (all 1.0 when K = 0).

    Quantiles by linear interpolation (numpy's default)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0:
        return {**{f"is_weight_p{q}": 1.0 for q in IS_WEIGHT_QUANTILES}, "is_weight_max": 1.0}
    values = np.percentile(w, IS_WEIGHT_QUANTILES)
    return {**{f"is_weight_p{q}": float(v) for q, v in zip(IS_WEIGHT_QUANTILES, values)},
            "is_weight_max": float(w.max())}


def is_weight_histogram(weights: np.ndarray, edges=IS_WEIGHT_BIN_EDGES) -> list[int]:
    """Counts of IS weights [K] per bin of `edges` [E] -> list of E - 1 ints; bin i holds
    [edges[i], edges[i + 1]) (the last bin also its right edge); weights below edges[0] or above edges[-1]
    are counted in the first or last bin."""
    e = np.asarray(edges, dtype=np.float64)
    w = np.clip(np.asarray(weights, dtype=np.float64).reshape(-1), e[0], e[-1])
    return np.histogram(w, bins=e)[0].astype(int).tolist()


def mismatch_kl(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[float, int]:
    """Training-inference mismatch as k3 estimates of KL(engine || learner) summed over masked tokens:
    ([B, T] x 3) -> (sum, count). The tokens were sampled by the engine, so k3 with the engine as the
    sampling policy is unbiased; pass only tokens of the learner's current weights (else staleness counts)."""
    mask = mask > 0
    if not mask.any():
        return 0.0, 0
    k3 = kl_penalty(rollout_logprobs.detach().double(), trainer_logprobs.detach().double(), "k3")
    return float(k3[mask].sum()), int(mask.sum())


class OffPolicyStats:
    """Adds up the off-policy metrics of one update over its micro-batches (state of one call only)."""

    def __init__(self, mode: str, current_version: int):
        self.mode, self.version = mode, int(current_version)
        self.staleness_max = self.span_max = 0
        self.weights: list[np.ndarray] = []
        self.tokens = self.dropped_tokens = self.samples = self.rejected = self.mismatch_n = 0
        self.mismatch_sum = 0.0

    def add(self, weight_versions: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
            rollout_logprobs: torch.Tensor, keep: torch.Tensor) -> None:
        """One micro-batch ([B, T] each): its loss mask, the learner's old logprobs, the engine's, and the
        mask that grpo.off_policy kept (off_policy_correction's `keep`)."""
        versions, mask = weight_versions.cpu(), mask.cpu()
        tokens = _policy_tokens(versions, mask)
        if tokens.any():
            self.staleness_max = max(self.staleness_max, int(token_staleness(versions, mask, self.version).max()))
            self.span_max = max(self.span_max, int(version_spans(versions, mask).max()))
            self.weights.append(torch.exp(old_logprobs.detach().cpu().double()
                                          - rollout_logprobs.detach().cpu().double())[tokens].numpy())
        loss_tokens, kept = mask > 0, keep.cpu() > 0
        self.tokens += int(loss_tokens.sum())
        self.dropped_tokens += int((loss_tokens & ~kept).sum())
        has_tokens = loss_tokens.any(dim=1)
        self.samples += int(has_tokens.sum())
        self.rejected += int((has_tokens & ~kept.any(dim=1)).sum())

    def add_mismatch(self, weight_versions: torch.Tensor, mask: torch.Tensor, rollout_logprobs: torch.Tensor,
                     trainer_logprobs: torch.Tensor) -> None:
        """Trainer logprobs taken with the update's weights (before its first optimizer step), [B, T] each."""
        current = (mask.cpu() > 0) & (weight_versions.cpu() == self.version)
        total, count = mismatch_kl(rollout_logprobs.cpu(), trainer_logprobs.cpu(), current)
        self.mismatch_sum += total
        self.mismatch_n += count

    def metrics(self) -> dict:
        """token_staleness_max, version_span_max, is_weight_p50/p90/p99/max, masked_token_share,
        rejected_sequence_share, logprob_mismatch_kl (k3; 0 when no token came from the current weights),
        logprob_mismatch_tokens, is_weight_hist ({"edges": [18], "counts": [17]})."""
        weights = np.concatenate(self.weights) if self.weights else np.zeros(0)
        return {
            "token_staleness_max": self.staleness_max, "version_span_max": self.span_max,
            **is_weight_quantiles(weights),
            "masked_token_share": self.dropped_tokens / max(self.tokens, 1) if self.mode == "masked_is" else 0.0,
            "rejected_sequence_share": self.rejected / max(self.samples, 1) if self.mode == "seq_reject" else 0.0,
            "logprob_mismatch_kl": self.mismatch_sum / max(self.mismatch_n, 1),
            "logprob_mismatch_tokens": self.mismatch_n,
            "is_weight_hist": {"edges": list(IS_WEIGHT_BIN_EDGES), "counts": is_weight_histogram(weights)},
        }
