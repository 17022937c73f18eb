"""RolloutBatches built by hand from per-sample token lists, as benchmarks and tests feed learners, and a row's whole
sequence back out (a run's batches come from the dock or from Samples: spillover.rollout.batch)."""
from __future__ import annotations

import numpy as np

from ..rollout.batch import RolloutBatch, offsets


def from_sequences(sequences, response_lengths, rollout_logprobs, weight_versions, advantages=None, n: int = 1,
                   loss_masks=None, labels=None) -> RolloutBatch:
    """From per-sample lists (prompt + response ids, response length, per-token logprobs and versions):
    rows form groups of n in order."""
    lengths = np.asarray(response_lengths, dtype=np.int64)
    seq = [np.asarray(t, dtype=np.int32) for t in sequences]
    prompt = [t[:len(t) - r] for t, r in zip(seq, lengths.tolist())]
    response = [t[len(t) - r:] for t, r in zip(seq, lengths.tolist())]
    cat = lambda parts, dtype: np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype)
    masks = loss_masks if loss_masks is not None else [np.ones(r, np.uint8) for r in lengths.tolist()]
    groups = len(seq) // n
    return RolloutBatch(group_ids=np.arange(groups, dtype=np.int64), n=n, prompt_tokens=cat(prompt, np.int32),
                        prompt_lengths=np.array([len(p) for p in prompt], dtype=np.int64),
                        response_tokens=cat(response, np.int32), response_lengths=lengths,
                        rollout_logprobs=cat(rollout_logprobs, np.float32), weight_versions=cat(weight_versions, np.int32),
                        loss_mask=cat(masks, np.uint8), truncated=np.zeros(len(seq), bool), ages=np.zeros(len(seq), np.int32),
                        labels=tuple(labels) if labels is not None else (None,) * groups,
                        advantages=None if advantages is None else np.asarray(advantages, np.float32).reshape(-1))


def row_sequence(batch: RolloutBatch, row: int) -> np.ndarray:
    """int32[L]: prompt + response ids of one row."""
    p, r = offsets(batch.prompt_lengths), batch.response_offsets
    return np.concatenate([batch.prompt_tokens[p[row]:p[row + 1]], batch.response_tokens[r[row]:r[row + 1]]])
