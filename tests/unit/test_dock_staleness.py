"""The staleness bound of the transfer dock (spillover.rollout.dock.staleness): it holds by group, in both modes, with
over-sampling, and cannot deadlock generation."""
from __future__ import annotations

import numpy as np
import pytest

from dock_helpers import group_order
from simulated_dock import token_staleness_max
from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.dock.staleness import counts_at_least, fresh_groups_allowed, staleness_bound_met


def put_lengths(dock: TransferDock, rows, lengths, eos, version) -> None:
    """Row r gets lengths[r] tokens 5, the last one EOS (0) where eos[r]."""
    tokens = [[5] * (m - 1) + [0 if e else 5] for m, e in zip(lengths, eos)]
    dock.put_generation(rows, tokens, [[0.0] * m for m in lengths], version, [False] * len(rows))


def test_a_split_group_is_held_at_max_age_issue_17():
    """Issue 17's reproduction: group 3 had one row generated (and carried) and its sibling never generated;
    the group is at max age - 1, so the batch waits for it instead of training the row max_age updates late."""
    dock = TransferDock(2, 2, 2, 8, 16, [0], require_max_age_all_finished=True)
    dock.load_groups([0, 1, 2, 3], [[1], [2], [3], [4]], list("abcd"))
    put_lengths(dock, dock.take_rows(4), [4, 1, 1, 1], [0, 1, 1, 1], 0)
    put_lengths(dock, dock.take_rows(4), [1, 1, 1, 1], [1, 1, 1, 1], 0)  # group 3: row 6 done, row 7 never generated
    dock.select_batch()
    dock.clear()
    assert dock.age[6:8].tolist() == [1, 1]  # every row of a group carries the group's age
    dock.load_groups([4, 5], [[5], [6]], list("ef"))
    rows = dock.take_rows(4)
    assert rows[0] == 7  # the group at max age goes first
    put_lengths(dock, rows, [4, 1, 1, 1], [0, 1, 1, 1], 1)
    assert dock.ready_group_count() == 2 and not dock.update_ready()  # group 3 (age 1 = max_age - 1) unfinished
    put_lengths(dock, dock.take_rows(1), [1], [1], 1)
    assert dock.update_ready()
    batch = dock.select_batch()
    assert 3 in dock.group_ids[batch].tolist()
    assert token_staleness_max(dock.batch_arrays()["weight_versions"], 1) == 1  # = max_age - 1, not 2


def test_bound_off_keeps_the_old_behaviour():
    dock = TransferDock(1, 2, 2, 8, 16, [0], require_max_age_all_finished=False)
    dock.load_groups([0, 1], [[1], [2]], ["a", "b"])
    put_lengths(dock, dock.take_rows(), [1, 1, 2, 2], [1, 1, 0, 0], 0)
    dock.select_batch()
    dock.clear()
    dock.load_groups([2], [[3]], ["c"])
    put_lengths(dock, dock.take_rows()[2:], [1, 1], [1, 1], 1)  # only the new group finishes
    assert dock.update_ready()  # the carried group 1 (age 1) is not waited for


def test_counts_and_the_bound_rule_by_hand():
    assert counts_at_least(np.array([0, 1, 1, 5]), 3).tolist() == [4, 3, 1]
    # gbs 2, max_age 2: three started groups of age 1 cannot all be trained in time; the batch must be the
    # two oldest (the overdue rule is capped at gbs, so finishing everything always satisfies it)
    assert staleness_bound_met(np.array([1, 1, 1, 0]), np.array([1, 1]), 2, 2)
    assert not staleness_bound_met(np.array([1, 1, 1, 0]), np.array([1, 0]), 2, 2)
    # max_age 3, gbs 1: ages [1, 1, 0] -> one of the age-1 groups now, the other next time
    assert staleness_bound_met(np.array([1, 1, 0]), np.array([1]), 3, 1)
    assert not staleness_bound_met(np.array([1, 1, 0]), np.array([0]), 3, 1)
    assert staleness_bound_met(np.array([0, 0]), np.array([0]), 3, 1)
    assert fresh_groups_allowed(3, 2, 2) == 1 and fresh_groups_allowed(9, 2, 2) == 0


def test_token_staleness_max_ignores_padding_and_sft_tokens():
    assert token_staleness_max(np.array([3, 4, 5, -1]), 5) == 2
    assert token_staleness_max(np.array([[-1, -1], [5, -1]]), 5) == 0
    assert token_staleness_max([], 7) == 0 and token_staleness_max([-1], 7) == 0


def test_over_sampling_starts_no_more_groups_than_max_age_batches_can_take():
    dock = TransferDock(1, 2, 2, 8, 16, [0], max_age=2, require_max_age_all_finished=True, over_sampling_groups=2)
    dock.load_groups([0, 1, 2, 3], [[1], [2], [3], [4]], list("abcd"))
    assert sorted(set((dock.take_rows() // 2).tolist())) == [0, 1]  # gbs * max_age = 2 groups may start
    free = TransferDock(1, 2, 2, 8, 16, [0], max_age=2, require_max_age_all_finished=False, over_sampling_groups=2)
    free.load_groups([0, 1, 2, 3], [[1], [2], [3], [4]], list("abcd"))
    assert len(free.take_rows()) == 8
    dock.set_drain(True)  # a drain generates everything
    assert len(dock.take_rows()) == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_bound_is_on_by_default_in_both_modes_and_can_be_turned_off(mode):
    cfg = RolloutConfig(mode=mode)
    assert cfg.require_max_age_all_finished and TransferDock.from_config(cfg, [0]).require_max_age_all_finished
    off = RolloutConfig(mode=mode, require_max_age_all_finished=False)
    assert not off.require_max_age_all_finished and not TransferDock.from_config(off, [0]).require_max_age_all_finished
    assert RolloutConfig(mode=mode, max_split=1, over_sampling_groups=2).effective_max_age == 2


def test_restore_refuses_rows_of_a_group_with_different_ages():
    """Every row carries its group's age; a snapshot saying otherwise is refused, not repaired."""
    dock = TransferDock(1, 2, 2, 8, 16, [0], require_max_age_all_finished=True)
    dock.load_groups([0, 1], [[1], [2]], ["a", "b"])
    arrays, meta = dock.snapshot()
    arrays["age"] = np.array([0, 0, 1, 1], dtype=np.int32)
    assert group_order(TransferDock.restore(arrays, meta, "m")).tolist() == [1, 0]
    arrays["age"] = np.array([0, 0, 1, 0], dtype=np.int32)
    with pytest.raises(ValueError, match="rows of one group have different ages"):
        TransferDock.restore(arrays, meta, "m")
