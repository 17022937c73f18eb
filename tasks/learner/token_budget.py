"""Micro-batches by tokens (learner.max_tokens_per_micro_batch; verl's use_dynamic_bsz and seqlen-balanced partitions).

A step's rows are split into one share per rank, then every share into the same number K of micro-batches (FSDP's
collectives run once per micro-batch on every rank), with near-equal token sums across ranks and across micro-batches
(a step's time is its slowest rank's, a micro-batch's memory its heaviest's). K is the smallest count for which every
micro-batch holds at most the budget, or one row that is alone over it. Everything here is a pure function of the
lengths (no randomness, stable sorts, ties to the lower index), so every rank and a resumed run cut the same way.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

__all__ = ["balanced_partition", "token_budget_micro_batches"]


def balanced_partition(lengths, parts: int) -> list[list[int]]:
    """Rows (lengths[N], tokens per row) -> `parts` lists of row indices, each ascending, with near-equal token sums.

    Longest row first to the lightest part (LPT; ties to the lower part): a row joins a part holding at most the mean
    load so far, so every part ends at most sum / parts + the longest row. Parts may be empty when parts > N."""
    if parts < 1:
        raise ValueError(f"a partition needs >= 1 parts; got {parts}")
    lengths = np.asarray(lengths, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(parts)]
    lightest = [(0, p) for p in range(parts)]  # (load, part): the heap pops the lightest, then the lower part
    for row in np.argsort(-lengths, kind="stable").tolist():
        load, part = heapq.heappop(lightest)
        out[part].append(row)
        heapq.heappush(lightest, (load + int(lengths[row]), part))
    return [sorted(rows) for rows in out]


def _fits(lengths: np.ndarray, rows: list[int], budget: int) -> bool:
    return len(rows) <= 1 or int(lengths[rows].sum()) <= budget


def _fewest(lengths: np.ndarray, budget: int) -> int:
    """A lower bound on the micro-batches of a share: one per row over the budget, the rest at most budget each."""
    over = lengths > budget
    return int(over.sum()) + math.ceil(int(lengths[~over].sum()) / budget)


def token_budget_micro_batches(lengths, world_size: int, budget: int) -> list[list[list[int]]]:
    """Rows (lengths[N]) -> [world_size][K] micro-batches of row indices: K the same on every rank, each micro-batch
    <= budget tokens (or one longer row alone), token-balanced shares and micro-batches.

    A rank's micro-batches come heaviest first (an out-of-memory shows at a step's first forward, not its last); a rank
    with fewer rows than K ends with empty micro-batches (the learner runs them as padding, for the collectives)."""
    if budget < 1:
        raise ValueError(f"learner.max_tokens_per_micro_batch must be >= 1; got {budget}")
    lengths = np.asarray(lengths, dtype=np.int64)
    shares = balanced_partition(lengths, world_size)
    k = max([1] + [_fewest(lengths[s], budget) for s in shares])
    while True:  # ends: at K = the largest share every micro-batch holds at most one row
        cut = [[[share[i] for i in mb] for mb in balanced_partition(lengths[share], k)] for share in shares]
        if all(_fits(lengths, mb, budget) for rank in cut for mb in rank):
            break
        k += 1
    return [sorted(rank, key=lambda mb: (-int(lengths[mb].sum()), mb[0] if mb else len(lengths))) for rank in cut]
