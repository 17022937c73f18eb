"""How the learner cuts a RolloutBatch (rollout/batch.py) into micro-batches: padded rows or one packed row.

Padded: sequences are right-padded; with a causal model and an attention mask, right padding leaves every real
position's logits unchanged and keeps the default position ids correct. Packed (learner.pack_sequences with a token
budget): the sequences are concatenated into one row [1, T] with position ids restarting at 0 per sequence and their
boundaries as cu_seqlens (flash attention's varlen convention), so no position is padding; attention stays within
each sequence (tasks/learner/packed_attention.py). Either way the response-token fields are [B, R] (B sequences,
R = longest response), so the loss code does not know which it got. Per-token values that travel next to the batch
(old and reference logprobs) are flat float32[Tr] columns in the batch's token order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...rollout.batch import RolloutBatch, offsets

__all__ = ["MicroBatch", "check_per_token", "make_micro_batch", "micro_batch_indices", "pad_per_token"]


@dataclass
class MicroBatch:
    """One micro-batch. B samples, R = longest response; padded: L = longest sequence; packed: T = their sum."""

    indices: list[int]            # rows of the RolloutBatch
    input_ids: torch.Tensor       # padded [B, L] right-padded; packed [1, T]
    attention_mask: torch.Tensor | None  # padded [B, L]; packed None (the boundaries are cu_seqlens)
    logit_positions: torch.Tensor  # [B, R] position whose logits predict each response token (packed: in the row)
    targets: torch.Tensor         # [B, R] response token ids (pad where masked)
    response_mask: torch.Tensor   # [B, R] 1 for real response tokens
    loss_mask: torch.Tensor       # [B, R] response_mask * the batch's loss mask
    advantages: torch.Tensor      # [B, 1]
    rollout_logprobs: torch.Tensor  # [B, R]
    weight_versions: torch.Tensor   # [B, R] (-1 on padding)
    position_ids: torch.Tensor | None = None  # packed [1, T]: 0, 1, ... within each sequence
    cu_seqlens: torch.Tensor | None = None    # packed int32[B + 1]: where each sequence starts in the row, then T
    max_seqlen: int = 0                       # packed: the longest sequence (varlen attention kernels ask for it)

    @property
    def computed_positions(self) -> int:
        """Positions the model runs over: B x L padded, T packed (padding_share's denominator)."""
        return self.input_ids.numel()


def micro_batch_indices(lengths, size: int) -> list[list[int]]:
    """Split sample indices into micro-batches of <= size, similar lengths together (less padding).

    Stable sort by length, so the split is a pure function of the lengths (determinism on resume).
    """
    if size < 1:
        raise ValueError(f"grpo.micro_batch_size must be >= 1; got {size}")
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable").tolist()
    return [order[k:k + size] for k in range(0, len(order), size)]


def _spans(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int, fill, dtype) -> torch.Tensor:
    """Rows of flat[starts[b] : starts[b] + lengths[b]] -> [B, width], right-padded with fill."""
    out = np.full((len(lengths), max(width, 0)), fill, dtype=dtype)
    for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        out[b, :n] = flat[s:s + n]
    return torch.from_numpy(out)


def make_micro_batch(batch: RolloutBatch, indices: list[int], pad_id: int, packed: bool = False) -> MicroBatch:
    """The rows `indices` of the batch as padded rows [B, L], or packed into one row [1, T] (packed=True)."""
    rows = np.asarray(indices, dtype=np.int64)
    p_len, r_len = batch.prompt_lengths[rows], batch.response_lengths[rows]
    seq = p_len + r_len
    seq_len, resp_len = int(seq.max()), max(int(r_len.max()), 1)
    p_start, r_start = offsets(batch.prompt_lengths)[rows], batch.response_offsets[rows]
    # padded: row b starts at column 0 of line b; packed: at column row_start[b] of the one line
    row_start = offsets(seq)[:-1] if packed else np.zeros(len(rows), dtype=np.int64)
    input_ids = np.full((1, int(seq.sum())) if packed else (len(rows), seq_len), pad_id, dtype=np.int64)
    for b, (ps, pl, rs, rl) in enumerate(zip(p_start.tolist(), p_len.tolist(), r_start.tolist(), r_len.tolist())):
        line, col = (0, int(row_start[b])) if packed else (b, 0)
        input_ids[line, col:col + pl] = batch.prompt_tokens[ps:ps + pl]
        input_ids[line, col + pl:col + pl + rl] = batch.response_tokens[rs:rs + rl]
    # logits at position p predict token p + 1: a response starting at prompt length P is predicted by
    # positions P - 1 ... P + R - 2 of its sequence (clamped into the sequence on padding, where the mask is 0 anyway).
    within = np.minimum(np.maximum(p_len[:, None] - 1 + np.arange(resp_len)[None, :], 0), seq[:, None] - 1)
    positions = row_start[:, None] + within
    response_mask = (np.arange(resp_len)[None, :] < r_len[:, None]).astype(np.float32)
    targets = _spans(batch.response_tokens, r_start, r_len, resp_len, pad_id, np.int64)
    loss_mask = _spans(batch.loss_mask, r_start, r_len, resp_len, 0, np.float32)
    advantages = batch.advantages[rows] if batch.advantages is not None else np.zeros(len(rows), np.float32)
    if packed:
        layout = dict(attention_mask=None, max_seqlen=seq_len,
                      position_ids=torch.from_numpy(np.concatenate([np.arange(n) for n in seq.tolist()])[None, :]),
                      cu_seqlens=torch.from_numpy(offsets(seq).astype(np.int32)))
    else:
        layout = dict(attention_mask=torch.from_numpy((np.arange(seq_len)[None, :] < seq[:, None]).astype(np.int64)))
    return MicroBatch(
        indices=list(indices), input_ids=torch.from_numpy(input_ids), **layout,
        logit_positions=torch.from_numpy(positions.astype(np.int64)), targets=targets,
        response_mask=torch.from_numpy(response_mask), loss_mask=loss_mask * torch.from_numpy(response_mask),
        advantages=torch.from_numpy(np.asarray(advantages, dtype=np.float32)).unsqueeze(1),
        rollout_logprobs=_spans(batch.rollout_logprobs, r_start, r_len, resp_len, 0.0, np.float32),
        weight_versions=_spans(batch.weight_versions, r_start, r_len, resp_len, -1, np.int64),
    )


def pad_per_token(values: np.ndarray, batch: RolloutBatch, indices: list[int], width: int) -> torch.Tensor:
    """A flat per-response-token column (e.g. old logprobs, float32[Tr]) -> [B, width] of the chosen rows."""
    rows = np.asarray(indices, dtype=np.int64)
    return _spans(np.asarray(values, dtype=np.float32), batch.response_offsets[rows], batch.response_lengths[rows],
                  width, 0.0, np.float32)


def check_per_token(name: str, values, batch: RolloutBatch) -> None:
    """values must be one number per response token of the batch (float[Tr])."""
    if values is None or np.ndim(values) != 1 or len(values) != len(batch.response_tokens):
        got = "None" if values is None else f"shape {np.shape(values)}"
        raise ValueError(f"{name} must be one value per response token ({len(batch.response_tokens)}); got {got}")
