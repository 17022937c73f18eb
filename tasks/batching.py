"""The learner's batch (TrainBatch) and how it is cut into padded micro-batches.

Sequences are right-padded: with a causal model and an attention mask, right padding leaves every
real position's logits unchanged and keeps the default position ids correct.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrainBatch:
    """Samples to train on, in plain lists (small; travels through Ray as is)."""

    tokens: list[list[int]]              # prompt + response ids per sample
    response_lengths: list[int]
    loss_masks: list[list[int]]          # per response token
    advantages: list[float]              # per sample (GRPO: the same for every token)
    rollout_logprobs: list[list[float]]  # per response token, from the engine
    weight_versions: list[list[int]]     # per response token

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_train_data(cls, train_data: dict, advantages, rollout_logprobs, weight_versions) -> "TrainBatch":
        """From `convert_samples_to_train_data` columns plus per-sample advantages ([N] or [G, n]) and the
        per-token rollout logprobs and weight versions of the same samples, in the same order."""
        for key in ("tokens", "response_lengths", "loss_masks"):
            if key not in train_data:
                raise ValueError(f"train_data has no {key!r} column (build it with convert_samples_to_train_data)")
        return cls(
            tokens=[list(map(int, t)) for t in train_data["tokens"]],
            response_lengths=[int(n) for n in train_data["response_lengths"]],
            loss_masks=[list(map(int, m)) for m in train_data["loss_masks"]],
            advantages=[float(a) for a in np.asarray(advantages, dtype=np.float64).reshape(-1)],
            rollout_logprobs=[list(map(float, lp)) for lp in rollout_logprobs],
            weight_versions=[list(map(int, v)) for v in weight_versions],
        )

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("response_lengths", "loss_masks", "advantages", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries but tokens has {n} "
                                 "samples; build every column from the same samples in the same order")
        for i, (toks, r) in enumerate(zip(self.tokens, self.response_lengths)):
            if r < 0 or (r > 0 and len(toks) - r < 1):
                raise ValueError(f"TrainBatch sample {i}: response_lengths={r} with {len(toks)} tokens; a "
                                 "response needs at least one prompt token before it")
            for name in ("loss_masks", "rollout_logprobs", "weight_versions"):
                if len(getattr(self, name)[i]) != r:
                    raise ValueError(f"TrainBatch sample {i}: {name} has {len(getattr(self, name)[i])} entries "
                                     f"but the response has {r} tokens")
        if not np.all(np.isfinite(self.advantages)):
            raise ValueError("TrainBatch.advantages must be finite (check the rewards for NaN)")


@dataclass
class MicroBatch:
    """One padded micro-batch. B samples, L = longest sequence, R = longest response."""

    indices: list[int]            # positions in the TrainBatch
    input_ids: torch.Tensor       # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    logit_positions: torch.Tensor  # [B, R] position whose logits predict each response token
    targets: torch.Tensor         # [B, R] response token ids (pad where masked)
    response_mask: torch.Tensor   # [B, R] 1 for real response tokens
    loss_mask: torch.Tensor       # [B, R] response_mask * the batch's loss mask
    advantages: torch.Tensor      # [B, 1]
    rollout_logprobs: torch.Tensor  # [B, R]
    weight_versions: torch.Tensor   # [B, R] (-1 on padding)


def micro_batch_indices(lengths: list[int], size: int) -> list[list[int]]:
    """Split sample indices into micro-batches of <= size, similar lengths together (less padding).

    Stable sort by length, so the split is a pure function of the lengths (determinism on resume).
    """
    if size < 1:
        raise ValueError(f"grpo.micro_batch_size must be >= 1; got {size}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[k:k + size] for k in range(0, len(order), size)]


def _pad(rows: list[list], width: int, value, dtype) -> torch.Tensor:
    out = torch.full((len(rows), max(width, 0)), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def make_micro_batch(batch: TrainBatch, indices: list[int], pad_id: int) -> MicroBatch:
    tokens = [batch.tokens[i] for i in indices]
    resp = [batch.response_lengths[i] for i in indices]
    seq_len, resp_len = max(len(t) for t in tokens), max(max(resp), 1)
    input_ids = _pad(tokens, seq_len, pad_id, torch.long)
    attention_mask = _pad([[1] * len(t) for t in tokens], seq_len, 0, torch.long)
    # logits at position p predict token p + 1: the response of a sample with L tokens and R response
    # tokens starts at L - R, so its predicting positions are L - R - 1 ... L - 2.
    positions = torch.zeros(len(indices), resp_len, dtype=torch.long)
    targets = torch.full((len(indices), resp_len), pad_id, dtype=torch.long)
    for row, (t, r) in enumerate(zip(tokens, resp)):
        if r:
            positions[row, :r] = torch.arange(len(t) - r - 1, len(t) - 1)
            targets[row, :r] = torch.tensor(t[len(t) - r:], dtype=torch.long)
    response_mask = _pad([[1] * r for r in resp], resp_len, 0, torch.float32)
    loss_mask = _pad([batch.loss_masks[i] for i in indices], resp_len, 0, torch.float32) * response_mask
    return MicroBatch(
        indices=list(indices), input_ids=input_ids, attention_mask=attention_mask, logit_positions=positions,
        targets=targets, response_mask=response_mask, loss_mask=loss_mask,
        advantages=torch.tensor([batch.advantages[i] for i in indices], dtype=torch.float32).unsqueeze(1),
        rollout_logprobs=_pad([batch.rollout_logprobs[i] for i in indices], resp_len, 0.0, torch.float32),
        weight_versions=_pad([batch.weight_versions[i] for i in indices], resp_len, -1, torch.long),
    )


def pad_per_token(values: list, indices: list[int], width: int) -> torch.Tensor:
    """Per-sample float lists (e.g. old logprobs) of the chosen samples -> [B, width], 0-padded."""
    return _pad([list(np.asarray(values[i], dtype=np.float32)) for i in indices], width, 0.0, torch.float32)
