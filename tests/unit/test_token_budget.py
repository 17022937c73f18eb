"""Micro-batches by tokens (tasks/learner/token_budget.py): every row once, within the budget, the same number of
micro-batches on every rank, balanced token sums, and the same cut for the same lengths."""
import numpy as np
import pytest

from spillover.tasks.learner.token_budget import balanced_partition, token_budget_micro_batches


def _long_tailed(rng, rows: int) -> np.ndarray:
    """Prompt + response lengths like a GRPO batch's: lognormal responses, a few at the cap."""
    return np.minimum(64 + rng.lognormal(np.log(300), 1.0, rows).astype(int), 2560)


def test_balanced_partition_covers_every_row_within_one_row_of_the_mean():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths, parts = rng.integers(1, 1000, int(rng.integers(0, 60))), int(rng.integers(1, 9))
        out = balanced_partition(lengths, parts)
        assert len(out) == parts and sorted(i for p in out for i in p) == list(range(len(lengths)))
        assert all(p == sorted(p) for p in out)
        if len(lengths):
            assert max(int(lengths[p].sum()) for p in out) <= lengths.sum() / parts + lengths.max()
    assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]  # 5 vs 5: counts need not match


def test_budget_respected_same_count_on_every_rank_every_row_once():
    rng = np.random.default_rng(1)
    for trial in range(100):
        world, budget = int(rng.integers(1, 5)), int(rng.integers(2560, 9000))
        lengths = _long_tailed(rng, int(rng.integers(1, 200)))
        cut = token_budget_micro_batches(lengths, world, budget)
        assert len(cut) == world and len({len(rank) for rank in cut}) == 1, trial  # FSDP: the same count per rank
        rows = [i for rank in cut for mb in rank for i in mb]
        assert sorted(rows) == list(range(len(lengths)))
        assert all(int(lengths[mb].sum()) <= budget for rank in cut for mb in rank), trial
        assert cut == token_budget_micro_batches(lengths.tolist(), world, budget)  # a pure function of the lengths


def test_few_micro_batches_with_balanced_tokens():
    rng = np.random.default_rng(2)
    lengths = _long_tailed(rng, 512)
    budget = 16384
    for world in (1, 2, 4):
        cut = token_budget_micro_batches(lengths, world, budget)
        share_sums = [sum(int(lengths[mb].sum()) for mb in rank) for rank in cut]
        assert max(share_sums) - min(share_sums) <= lengths.max()  # ranks: within one row
        fewest = int(np.ceil(max(share_sums) / budget))
        assert len(cut[0]) <= fewest + 1, (world, len(cut[0]), fewest)  # at most one more than the bound allows
        sums = [int(lengths[mb].sum()) for rank in cut for mb in rank]
        assert max(sums) - min(sums) <= lengths.max(), (world, sums)  # micro-batches: within one row
        for rank in cut:  # heaviest first
            loads = [int(lengths[mb].sum()) for mb in rank]
            assert loads == sorted(loads, reverse=True)


def test_rows_longer_than_the_budget_go_alone_and_short_ranks_get_empty_micro_batches():
    assert token_budget_micro_batches([50, 3, 3, 40], 1, 10) == [[[0], [3], [1, 2]]]
    assert token_budget_micro_batches([9, 9, 9], 2, 10) == [[[0], [2]], [[1], []]]  # rank 1: one padding micro-batch
    assert token_budget_micro_batches([4], 3, 10) == [[[0]], [[]], [[]]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget_micro_batches([1], 1, 0)
