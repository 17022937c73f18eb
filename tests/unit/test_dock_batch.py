"""The transfer dock's batch rules (rollout/dock/transfer_dock.py) on small docks: ready groups and the batch chosen
once, clear and ageing, drain, the max-age rule, snapshot/restore. Loading and generation: test_dock.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from dock_helpers import finish_groups, group_order, load, make_dock, put

from spillover.infra.storage.format_version import FormatVersionError
from spillover.rollout.batch import to_samples
from spillover.rollout.dock.transfer_dock import DockError, TransferDock


def test_ready_groups_update_ready_and_batch_chosen_once():
    dock = make_dock(gbs=2, n=2, max_split=2)
    load(dock, [0, 1, 2, 3])
    rows = dock.take_rows()
    put(dock, rows, 1, eos=[True, True, True, False, True, True, True, True])
    assert dock.ready_group_count() == 3 and dock.update_ready()
    batch = dock.select_batch()
    assert batch.tolist() == [0, 2]  # ready groups in load order (all age 0)
    assert dock.batch_group_ids().tolist() == [0, 2]
    rest = dock.take_rows()
    put(dock, rest, 1, eos=True)  # group 1 becomes ready too: the batch does not change
    assert dock.select_batch().tolist() == [0, 2]
    samples = to_samples(dock.rollout_batch())
    assert [[s.index for s in g] for g in samples] == [[0, 1], [4, 5]]
    assert [g[0].label for g in samples] == ["label-0", "label-2"]
    arrays = dock.batch_arrays()
    assert arrays["sample_indices"].tolist() == [0, 1, 4, 5] and not arrays["response_tokens"].flags.writeable
    assert arrays["response_tokens"].tolist() == sum((s.response_tokens for g in samples for s in g), [])
    assert arrays["weight_versions"].tolist() == [1, 1, 1, 1]


def test_partial_rows_count_rows_cut_with_tokens_not_rows_aborted_before_their_first_token():
    """An abort answers the rows still queued with no tokens: they were generated (carried_rows) but hold nothing to
    continue, so they are not partial rows (counting them made a run that cut nothing look like partial rollout)."""
    dock = make_dock(gbs=1, n=2, max_split=4)
    load(dock, [0, 1])
    rows = dock.take_rows()
    put(dock, rows, [3, 3, 2, 0], eos=[True, True, False, False])
    assert dock.stats()["partial_rows"] == 1
    dock.select_batch()
    stats = dock.clear()
    assert (stats["carried_rows"], stats["partial_rows"]) == (2, 1)


def test_select_batch_needs_gbs_ready_groups_and_consumers_need_a_batch():
    dock = make_dock(gbs=2)
    load(dock, [0, 1])
    with pytest.raises(DockError, match="select_batch"):
        dock.select_batch()
    for call in (dock.rollout_batch, dock.batch_arrays, dock.batch_group_ids, dock.clear):
        with pytest.raises(DockError, match="no batch selected"):
            call()


def test_clear_drops_batch_ages_started_groups_and_orders_oldest_first():
    dock = make_dock(gbs=1, n=2, max_split=4)
    load(dock, [0, 1])
    rows = dock.take_rows(limit=3)  # rows 0, 1, 2: group 1's row 3 is never generated
    put(dock, rows, 1, eos=[True, True, False])
    dock.select_batch()
    stats = dock.clear()
    assert stats["trained_groups"] == 1 and stats["carried_rows"] == 1 and stats["partial_rows"] == 1
    assert dock.age[2:4].tolist() == [1, 1] and dock.age[:2].tolist() == [0, 0]  # a group ages as one
    assert dock.group_ids.tolist() == [-1, 1] and dock.labels[0] is None
    load(dock, [2])  # slot 0, newer
    assert group_order(dock).tolist() == [1, 0]
    finish_groups(dock, [0])
    dock.take_rows()
    put(dock, [2, 3], 1, eos=True)
    assert dock.ready_group_count() == 2
    assert dock.select_batch().tolist() == [1]  # the older group goes first even though slot 0 is lower


def test_clear_refuses_rows_in_flight_and_load_refuses_during_a_batch():
    dock = make_dock(gbs=1, n=2)
    load(dock, [0, 1])
    finish_groups(dock, [0])
    dock.take_rows()
    dock.select_batch()
    with pytest.raises(DockError, match="in flight"):
        dock.clear()
    with pytest.raises(DockError, match="clear"):
        load(dock, [5])
    dock.release([2, 3])
    dock.clear()
    assert dock.generated[2:4].tolist() == [False, False] and dock.age[2:4].tolist() == [0, 0]


def test_drain_mode_waits_for_every_loaded_row_and_empties_the_dock():
    dock = make_dock(gbs=2, n=2, max_split=2)
    load(dock, [0, 1, 2])
    put(dock, dock.take_rows(), 1, eos=[True, True, True, True, False, False])
    assert dock.update_ready()
    dock.set_drain(True)
    assert not dock.update_ready()
    put(dock, dock.take_rows(), 1, eos=True)
    assert dock.update_ready()
    assert len(dock.select_batch()) == 2
    dock.clear()
    assert dock.update_ready()  # the one group left is complete
    assert dock.select_batch().tolist() == [2]  # fewer than gbs in drain mode
    dock.clear()
    assert dock.stats()["loaded_groups"] == 0 and not dock.update_ready()


def test_require_max_age_all_finished_holds_until_old_rows_finish():
    dock = make_dock(gbs=1, n=2, max_split=2, require_max_age_all_finished=True)  # max_age 2: age >= 1 must finish
    load(dock, [0, 1])
    put(dock, dock.take_rows(), 1, eos=[True, True, False, False])
    dock.select_batch()
    dock.clear()  # group 1 carried, age 1 = max age - 1
    load(dock, [2])
    put(dock, dock.take_rows(limit=2), 1, eos=[False, False])  # the old rows 2, 3 generate but do not finish
    finish_groups(dock, [0])
    assert dock.ready_group_count() == 1 and not dock.update_ready()
    put(dock, dock.take_rows(limit=2), 1, eos=True)
    assert dock.update_ready()
    assert make_dock(gbs=1).max_age == 2 and make_dock(gbs=1, max_age=5).max_age == 5


def test_snapshot_restore_equal_state_and_behaviour(tmp_path):
    from safetensors.numpy import load_file, save_file

    dock = make_dock(gbs=2, n=2, max_split=3, max_tokens=9, max_model_len=20)
    load(dock, [0, 1, 2, 3])
    put(dock, dock.take_rows(), [3, 1, 3, 3, 1, 1, 2, 3], eos=[False, True, False, True, True, True, False, False])
    in_flight = dock.take_rows(limit=2)
    arrays, meta = dock.snapshot()
    save_file(arrays, str(tmp_path / "dock.safetensors"))
    meta = json.loads(json.dumps(meta))
    restored = TransferDock.restore(load_file(str(tmp_path / "dock.safetensors")), meta, str(tmp_path))
    again, meta_again = restored.snapshot()
    assert meta_again == meta and all(np.array_equal(arrays[k], again[k]) for k in arrays)
    assert restored.in_flight.sum() == 0 and dock.in_flight[in_flight].all()  # requests die with the process
    dock.release(in_flight)
    for d in (dock, restored):  # both continue the same way
        rows = d.take_rows()
        put(d, rows, 2, eos=True, version=7)
        d.select_batch()
    assert to_samples(dock.rollout_batch()) == to_samples(restored.rollout_batch())
    assert dock.clear() == restored.clear()


def test_snapshot_with_a_selected_batch_and_bad_snapshots():
    dock = make_dock(gbs=1)
    load(dock, [0, 1])
    finish_groups(dock, [1])
    dock.select_batch()
    arrays, meta = dock.snapshot()
    restored = TransferDock.restore(arrays, meta, "a snapshot in memory")
    assert restored.select_batch().tolist() == [1] and restored.batch_group_ids().tolist() == [1]
    with pytest.raises(FormatVersionError, match=r"dock snapshot in ckpt/meta.json has format tag 'other'"):
        TransferDock.restore(arrays, {**meta, "format": "other"}, "ckpt/meta.json")
    with pytest.raises(FormatVersionError, match=r"dock snapshot in ckpt/meta.json has spillover.dock format version 2 "
                       r"\(written by a newer release\); this release reads version 1 only"):
        TransferDock.restore(arrays, {**meta, "format": "spillover.dock/2"}, "ckpt/meta.json")
    with pytest.raises(ValueError, match=r"arrays \['age'\] missing"):
        TransferDock.restore({k: v for k, v in arrays.items() if k != "age"}, meta, "m")
    with pytest.raises(ValueError, match=r"meta \['metadata'\] missing"):
        TransferDock.restore(arrays, {k: v for k, v in meta.items() if k != "metadata"}, "m")
    with pytest.raises(ValueError, match="shape"):
        TransferDock.restore({**arrays, "age": arrays["age"][:-1]}, meta, "m")
