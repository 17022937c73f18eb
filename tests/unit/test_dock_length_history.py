"""The dock's per-prompt length history (rollout/dock/length_history.py): recorded when a group is trained, found again
by a later epoch's group of the same prompt, kept by snapshot/restore; and rollout.start_order = predicted_longest
starting the groups predicted longest first (rollout/drivers/scheduling.py)."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.length_history import LengthHistory, prediction_metrics, prompt_keys
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.scheduling import expected_remaining, plan_dispatch

from dock_helpers import make_dock, put


def load_prompts(dock: TransferDock, ids, prompts) -> np.ndarray:
    return dock.load_groups(np.asarray(ids), prompts, [f"label-{g}" for g in ids])


def train_one_batch(dock: TransferDock, lengths: dict[int, int]) -> None:
    """Every loaded row finishes with its group's length (EOS last); the batch trains and leaves."""
    rows = dock.take_rows()
    put(dock, rows, [lengths[int(dock.group_ids[r // dock.n])] for r in rows.tolist()], eos=True)
    dock.select_batch()
    dock.clear()


def test_prompt_keys_name_the_tokens():
    keys = prompt_keys(np.array([5, 6, 7, 5, 6, 7, 5]), np.array([3, 3, 1]))
    assert keys[0] == keys[1] != keys[2]
    assert prompt_keys(np.array([5, 6, 7]), np.array([3]))[0] == keys[0]  # the same in any call (no salted hash)


def test_history_recorded_at_clear_and_found_next_epoch():
    dock = make_dock(gbs=2, n=2, max_split=1)
    load_prompts(dock, [0, 1], [[1, 2], [3, 4]])
    assert np.isnan(dock.predicted_length(np.arange(2))).all()
    train_one_batch(dock, {0: 6, 1: 2})
    slots = load_prompts(dock, [2, 3], [[3, 4], [9]])  # epoch 2: prompt [3, 4] again, and a new one
    assert dock.predicted_length(slots)[0] == 2.0 and np.isnan(dock.predicted_length(slots)[1])
    train_one_batch(dock, {2: 4, 3: 1})
    slots = load_prompts(dock, [4, 5], [[3, 4], [1, 2]])
    assert dock.predicted_length(slots).tolist() == [3.0, 6.0]  # an average over epochs (HISTORY_WEIGHT 0.5)


def test_caller_keys_and_snapshot_restore():
    dock = make_dock(gbs=2, n=2, max_split=2)
    dock.load_groups(np.array([0, 1]), [[1], [2]], ["a", "b"], keys=[70, 71])
    train_one_batch(dock, {0: 5, 1: 3})
    slots = dock.load_groups(np.array([2]), [[8]], ["c"], keys=[71])
    arrays, meta = dock.snapshot()
    restored = TransferDock.restore(arrays, meta, "test")
    assert restored.predicted_length(slots).tolist() == [3.0] == dock.predicted_length(slots).tolist()
    assert restored.length_history.lengths == {70: 5.0, 71: 3.0}
    # a snapshot from before the history: keys from the prompts' tokens, an empty history
    old = {k: v for k, v in arrays.items() if k not in ("prompt_keys", "history_keys", "history_lengths")}
    restored = TransferDock.restore(old, meta, "test")
    assert len(restored.length_history) == 0
    assert restored.prompt_keys[slots].tolist() == prompt_keys(np.array([8]), np.array([1])).tolist()
    with pytest.raises(ValueError, match="keys"):
        dock.load_groups(np.array([3]), [[8]], ["d"], keys=[1, 2])


def test_clear_reports_what_each_group_was_predicted_when_it_started():
    """clear() returns each trained group's prediction as it stood when the group started (a group still waiting at a
    clear takes the history as it is after it; one already started keeps its own) and its true mean length; snapshots
    keep the predictions (an older snapshot takes the history's)."""
    dock = make_dock(gbs=1, n=2, max_split=2)  # two group slots
    dock.load_groups(np.array([0, 1]), [[1], [1]], ["a", "a"], keys=[10, 10])  # one prompt twice
    put(dock, dock.take_rows(limit=2), [4, 2], eos=True)  # only group 0 starts
    dock.select_batch()
    stats = dock.clear()
    assert stats["predicted_group_len"] == [None] and stats["true_group_len"] == [3.0]
    assert dock.start_predictions[1] == 3.0  # group 1 had not started: it starts knowing group 0's length
    dock.load_groups(np.array([2]), [[2]], ["b"], keys=[11])
    put(dock, dock.take_rows(), [5, 5, 1, 1], eos=[True, True, False, False])  # group 2 starts (no history)
    arrays, meta = dock.snapshot()
    restored = TransferDock.restore(arrays, meta, "test")
    assert np.array_equal(restored.start_predictions, dock.start_predictions, equal_nan=True)
    older = TransferDock.restore({k: v for k, v in arrays.items() if k != "start_predictions"}, meta, "test")
    assert older.start_predictions[dock.group_ids == 1].tolist() == [3.0]
    dock.select_batch()
    stats = dock.clear()
    assert stats["predicted_group_len"] == [3.0] and stats["true_group_len"] == [5.0]
    dock.load_groups(np.array([3]), [[1]], ["a"], keys=[10])  # epoch 2 of prompt 10: (3 + 5) / 2
    put(dock, dock.take_rows(), [1, 1, 2, 2], eos=True)
    dock.select_batch()
    assert dock.clear()["predicted_group_len"] == [None]  # group 2 started with no history, and keeps that
    assert dock.start_predictions[dock.group_ids == 3].tolist() == [4.0]


def test_prediction_metrics_are_json_safe():
    got = prediction_metrics(np.array([np.nan, 2.0, 4.0, 6.0]), np.array([1.0, 3.0, 4.0, 8.0]))
    assert got["predicted_group_len"] == [None, 2.0, 4.0, 6.0] and got["true_group_len"] == [1.0, 3.0, 4.0, 8.0]
    assert got["predicted_groups"] == 3 and got["predictor_r"] == pytest.approx(
        np.corrcoef([2.0, 4.0, 6.0], [3.0, 4.0, 8.0])[0, 1], abs=1e-4)  # over the groups with a prediction
    assert prediction_metrics(np.array([np.nan, 2.0]), np.array([1.0, 3.0]))["predictor_r"] is None  # too few
    assert prediction_metrics(np.full(4, 2.0), np.arange(4.0))["predictor_r"] is None  # a constant prediction
    assert prediction_metrics(np.zeros(0), np.zeros(0)) == {"predicted_group_len": [], "true_group_len": [],
                                                            "predicted_groups": 0, "predictor_r": None}


def test_length_history_load_refuses_mismatched_arrays():
    with pytest.raises(ValueError):
        LengthHistory.load(np.zeros(2), np.zeros(3))


def test_history_is_a_floor_over_siblings_and_the_prior():
    lengths = np.array([10, 0, 0, 0])
    complete = np.array([True, False, False, False])
    rows = np.array([1, 2, 3])
    room = np.full(3, 100)
    assert expected_remaining(lengths, complete, room, 2, rows).tolist() == [10.0, 10.0, 10.0]
    history = np.array([40.0, np.nan, 25.0])
    assert expected_remaining(lengths, complete, room, 2, rows, history=history).tolist() == [40.0, 10.0, 25.0]


def test_predicted_longest_starts_the_long_prompts_first():
    dock = make_dock(gbs=3, n=2, max_split=1, max_tokens=64, max_model_len=80)
    dock.load_groups(np.array([0, 1, 2]), [[1], [2], [3]], ["a", "b", "c"], keys=[10, 11, 12])
    train_one_batch(dock, {0: 2, 1: 30, 2: 9})
    dock.load_groups(np.array([3, 4, 5]), [[1], [2], [3]], ["a", "b", "c"], keys=[10, 11, 12])
    rows = dock.take_rows()
    oldest, _, _ = plan_dispatch(dock, rows, "length_aware")
    predicted, _, _ = plan_dispatch(dock, rows, "length_aware", start_order="predicted_longest")
    assert (oldest // 2).tolist() == [0, 0, 1, 1, 2, 2]  # today: load order (every fresh group expects the prior)
    assert (predicted // 2).tolist() == [1, 1, 2, 2, 0, 0]  # the prompt that ran 30 tokens first
    with pytest.raises(ValueError, match="start_order"):
        plan_dispatch(dock, rows, "length_aware", start_order="random")


def test_start_order_needs_length_aware():
    with pytest.raises(ValueError, match="length_aware"):
        RolloutConfig(start_order="predicted_longest")
    assert RolloutConfig(start_order="predicted_longest", scheduling="length_aware").start_order == "predicted_longest"


def test_start_budget_drops_to_gbs_times_max_age_minus_one_once_the_batch_is_chosen():
    # issue 38: prompts loaded before the update start during it, and age with the batch's clear as if started under
    # the old weights; so while a batch is chosen, the groups outside it may number at most gbs x (max_age - 1): the
    # batch's groups count as active until clear (staleness.groups_held_back), which gives exactly that budget
    dock = make_dock(gbs=2, n=2, max_split=2, max_age=2, require_max_age_all_finished=True, over_sampling_groups=2)
    load_prompts(dock, [0, 1, 2, 3], [[1], [2], [3], [4]])
    rows = dock.take_rows()
    assert sorted(set((rows // 2).tolist())) == [0, 1, 2, 3]  # gbs x max_age = 4 may be active
    put(dock, rows, [3, 3, 3, 3, 1, 1, 1, 1], eos=[True] * 4 + [False] * 4)
    load_prompts(dock, [4, 5], [[5], [6]])  # loaded before the update (the dock refuses loads once a batch is chosen)
    dock.select_batch()
    started = set((dock.take_rows() // 2).tolist())
    outside = {2, 3} | {slot for slot in started if dock.group_ids[slot] in (4, 5)}
    assert len(outside) <= dock.gbs * (dock.max_age - 1)
    dock.release(np.flatnonzero(dock.in_flight))
    dock.clear()
    assert (dock.group_age()[dock.started_groups()] <= dock.max_age - 1).all()
