"""The transfer dock's rules (rollout/dock.py), one test per rule, on small docks."""
from __future__ import annotations

import json

import numpy as np
import pytest

from infra.config import RolloutConfig
from rollout.dock import DockError, TransferDock
from rollout.dock_buffers import PagedColumns
from rollout.sample import Status

EOS = 0


def make_dock(gbs=2, n=2, max_split=2, max_tokens=8, max_model_len=16, **kw) -> TransferDock:
    return TransferDock(gbs, n, max_split, max_tokens, max_model_len, [EOS], **kw)


def load(dock: TransferDock, ids, prompt_len=2) -> np.ndarray:
    return dock.load_groups(np.asarray(ids), [[100 + g] * prompt_len for g in ids], [f"label-{g}" for g in ids])


def put(dock: TransferDock, rows, lengths, eos=False, version=1, stop=None) -> None:
    """Each row gets `length` tokens 10, 11, ...; the last one EOS when eos."""
    rows = np.asarray(rows)
    lengths = np.broadcast_to(np.asarray(lengths), rows.shape)
    eos = np.broadcast_to(np.asarray(eos), rows.shape)
    tokens = [list(range(10, 10 + m)) for m in lengths.tolist()]
    for t, e in zip(tokens, eos.tolist()):
        if e and t:
            t[-1] = EOS
    stop = np.zeros(len(rows), bool) if stop is None else np.asarray(stop)
    dock.put_generation(rows, tokens, [[-0.5] * len(t) for t in tokens], version, stop)


def finish_groups(dock: TransferDock, slots) -> None:
    """Complete every row of these group slots with a 1-token EOS answer (rows must be waiting)."""
    rows = (np.asarray(slots)[:, None] * dock.n + np.arange(dock.n)).reshape(-1)
    dock.in_flight[rows] = True  # as if take_rows handed exactly these out
    put(dock, rows, 1, eos=True)


def test_capacity_and_loading_2gbs_then_gbs():
    dock = make_dock(gbs=3, n=2, max_split=4)
    assert dock.partial and dock.capacity_groups == 6 and dock.capacity_rows == 12
    assert dock.groups_to_load(first_iteration=True) == 6
    slots = load(dock, range(6))
    assert slots.tolist() == list(range(6))
    assert dock.groups_to_load(first_iteration=False) == 0  # full: limited by free slots
    finish_groups(dock, [0, 1, 2])
    dock.select_batch()
    dock.clear()
    assert dock.groups_to_load(first_iteration=False) == 3
    plain = make_dock(gbs=3, max_split=1)
    assert not plain.partial and plain.capacity_groups == 3
    assert plain.groups_to_load(first_iteration=True) == 3


def test_from_config():
    cfg = RolloutConfig(global_batch_size=4, n_samples_per_prompt=3, max_split=2, max_tokens=16, max_model_len=40,
                        require_max_age_all_finished=True)
    dock = TransferDock.from_config(cfg, [7, 8])
    assert (dock.gbs, dock.n, dock.capacity_groups, dock.max_age, dock.sync_round_tokens) == (4, 3, 8, 2, 8)
    assert dock.require_max_age_all_finished and dock.eos_token_ids.tolist() == [7, 8]


def test_load_refuses_bad_input():
    dock = make_dock()
    load(dock, [5])
    with pytest.raises(ValueError, match="already in the dock"):
        load(dock, [5])
    with pytest.raises(ValueError, match="twice"):
        load(dock, [6, 6])
    with pytest.raises(ValueError, match="free slots"):
        load(dock, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="max_model_len"):
        dock.load_groups([9], [[1] * 16], ["x"])
    with pytest.raises(ValueError, match="max_model_len"):
        dock.load_groups([9], [[]], ["x"])
    with pytest.raises(ValueError, match="JSON"):
        dock.load_groups([9], [[1]], [object()])
    with pytest.raises(ValueError, match="integers"):
        dock.load_groups([9], [[1.5]], ["x"])
    with pytest.raises(ValueError, match=">= 0"):
        dock.load_groups([-1], [[1]], ["x"])
    assert dock.stats()["loaded_groups"] == 1


def test_take_order_carried_first_oldest_first_then_load_order():
    dock = make_dock(gbs=2, n=2, max_split=4, max_tokens=8)
    load(dock, [10, 11, 12, 13])  # slots 0..3
    rows = dock.take_rows()
    assert rows.tolist() == list(range(8))  # new prompts in load order
    put(dock, rows, 2)  # nothing finished
    finish_rows = np.arange(4)  # groups 10, 11 finish
    dock.in_flight[finish_rows] = True
    put(dock, finish_rows, 1, eos=True)
    dock.select_batch()
    dock.clear()  # 12, 13 carried with age 1
    load(dock, [14, 15])  # into the freed slots 0, 1
    assert dock.group_ids.tolist() == [14, 15, 12, 13]
    taken = dock.take_rows(limit=6)
    assert taken.tolist() == [4, 5, 6, 7, 0, 1]  # carried (12, 13) first, then new prompts in load order
    assert dock.in_flight[taken].all() and not dock.in_flight[[2, 3]].any()
    assert dock.take_rows().tolist() == [2, 3]  # in-flight rows are not handed out twice
    assert dock.take_rows().tolist() == []


def test_generation_inputs_and_max_new_tokens():
    dock = make_dock(gbs=1, n=2, max_split=2, max_tokens=8, max_model_len=12)
    dock.load_groups([0, 1], [[5, 6, 7], [8] * 6], ["a", "b"])
    rows = dock.take_rows()
    ids, max_new = dock.generation_inputs(rows, dock.sync_round_tokens)
    assert ids == [[5, 6, 7], [5, 6, 7], [8] * 6, [8] * 6]
    assert list(ids) == ids.to_lists() and ids[-1] == [8] * 6 and len(ids) == 4
    assert max_new.tolist() == [4, 4, 4, 4]
    put(dock, rows, [4, 1, 4, 2])
    rows = dock.take_rows()
    ids, max_new = dock.generation_inputs(rows, None)
    assert ids[0] == [5, 6, 7, 10, 11, 12, 13] and ids[1] == [5, 6, 7, 10]
    # max_tokens - response = 4, 7; max_model_len - prompt - response = 12-6-4 = 2, 12-6-2 = 4
    assert max_new.tolist() == [4, 7, 2, 4]
    assert dock.generation_inputs(rows, 3)[1].tolist() == [3, 3, 2, 3]
    assert ids.flat().tolist() == sum(ids.to_lists(), [])


def test_completion_rules():
    dock = make_dock(gbs=1, n=4, max_split=2, max_tokens=6, max_model_len=10)
    dock.load_groups([0, 1], [[1, 2], [3] * 5], ["a", "b"])
    rows = dock.take_rows()  # 0-3: prompt 2; 4-7: prompt 5
    tokens = [[9, EOS], [9, EOS, 9], [9, 9], [9, 9, 9], [9, 9, 9, 9, 9], [9], [9], [9]]
    stop = [False, False, False, True, False, False, False, False]
    dock.put_generation(rows, tokens, [[0.0] * len(t) for t in tokens], 3, stop)
    # row 0: EOS last -> complete; row 1: EOS not last -> waits; row 2: waits; row 3: stop -> complete;
    # row 4: 5+5 = max_model_len -> complete (truncated); rows 5-7 wait
    assert dock.complete[:8].tolist() == [True, False, False, True, True, False, False, False]
    rows = dock.take_rows()
    assert rows.tolist() == [1, 2, 5, 6, 7]
    dock.put_generation(rows, [[9, 9, 9], [9, 9, 9, 9], [EOS], [9], [9, 9]], [[0.0] * m for m in (3, 4, 1, 1, 2)],
                        4, np.zeros(5, bool))
    # row 1: 6 tokens = max_tokens -> complete; row 2: 6 -> complete; row 5: EOS; 6, 7 wait
    assert dock.complete[:8].tolist() == [True, True, True, True, True, True, False, False]
    assert dock.ready_group_count() == 1
    dock.select_batch()
    statuses = [s.status for s in dock.batch_samples()[0]]
    assert statuses == [Status.COMPLETED, Status.TRUNCATED, Status.TRUNCATED, Status.COMPLETED]


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
    samples = dock.batch_samples()
    assert [[s.index for s in g] for g in samples] == [[0, 1], [4, 5]]
    assert [g[0].label for g in samples] == ["label-0", "label-2"]
    arrays = dock.batch_arrays()
    assert arrays["sample_indices"].tolist() == [0, 1, 4, 5] and not arrays["response_tokens"].flags.writeable
    assert arrays["response_tokens"].tolist() == sum((s.response_tokens for g in samples for s in g), [])
    assert arrays["weight_versions"].tolist() == [1, 1, 1, 1]


def test_select_batch_needs_gbs_ready_groups_and_consumers_need_a_batch():
    dock = make_dock(gbs=2)
    load(dock, [0, 1])
    with pytest.raises(DockError, match="select_batch"):
        dock.select_batch()
    for call in (dock.batch_samples, dock.batch_arrays, dock.batch_group_ids, dock.clear):
        with pytest.raises(DockError, match="no batch selected"):
            call()


def test_clear_drops_batch_ages_generated_rows_and_orders_oldest_first():
    dock = make_dock(gbs=1, n=2, max_split=4)
    load(dock, [0, 1])
    rows = dock.take_rows(limit=3)  # rows 0, 1, 2: group 1's row 3 is never generated
    put(dock, rows, 1, eos=[True, True, False])
    dock.select_batch()
    stats = dock.clear()
    assert stats["trained_groups"] == 1 and stats["carried_rows"] == 1 and stats["partial_rows"] == 1
    assert dock.age[2:4].tolist() == [1, 0] and dock.age[:2].tolist() == [0, 0]
    assert dock.group_ids.tolist() == [-1, 1] and dock.labels[0] is None
    load(dock, [2])  # slot 0, newer
    assert dock.group_order().tolist() == [1, 0]
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


def test_put_generation_misuse_changes_nothing():
    dock = make_dock(gbs=1, n=2, max_tokens=4)
    load(dock, [0, 1])
    rows = dock.take_rows(limit=2)
    before, _ = dock.snapshot()
    flight = dock.in_flight.copy()
    cases = [
        (DockError, "not in flight", dict(rows=[2])),
        (ValueError, "more than once", dict(rows=[0, 0])),
        (IndexError, "out of range", dict(rows=[-1])),
        (IndexError, "out of range", dict(rows=[4])),
        (ValueError, "rows must be", dict(rows=[0.5])),
        (ValueError, "entries in tokens", dict(tokens=[[1]])),
        (ValueError, "logprobs", dict(logprobs=[[0.0], [0.0, 0.0]])),
        (ValueError, "room", dict(tokens=[[1] * 5, [1]], logprobs=[[0.0] * 5, [0.0]])),
        (ValueError, "integers", dict(tokens=[[1.5], [1]])),
        (ValueError, "2\\*\\*31", dict(tokens=[[-3], [1]])),
        (ValueError, "finished_by_stop", dict(stop=[False])),
        (ValueError, "weight_version", dict(version=[1, 2, 3])),
        (ValueError, "lengths sum", dict(tokens=(np.array([1, 2]), np.array([1, 2])))),
    ]
    for error, message, override in cases:
        args = dict(rows=rows, tokens=[[1], [1]], logprobs=[[0.0], [0.0]], version=1, stop=[False, False])
        args.update(override)
        with pytest.raises(error, match=message):
            dock.put_generation(args["rows"], args["tokens"], args["logprobs"], args["version"], args["stop"])
        after, _ = dock.snapshot()
        assert all(np.array_equal(before[k], after[k]) for k in before) and (dock.in_flight == flight).all()
    put(dock, rows, 1)
    with pytest.raises(DockError, match="not in flight"):  # a double write
        put(dock, rows, 1)
    with pytest.raises(DockError, match="not in flight"):
        dock.release(rows)


def test_flat_input_equals_list_input_and_per_row_versions():
    a, b = make_dock(gbs=1, n=2), make_dock(gbs=1, n=2)
    for dock in (a, b):
        load(dock, [0, 1])
    rows = a.take_rows()
    b.take_rows()
    tokens, logprobs = [[3, 4], [], [5], [6, EOS]], [[-1.0, -2.0], [], [-3.0], [-4.0, -5.0]]
    a.put_generation(rows, tokens, logprobs, [1, 2, 3, 4], np.zeros(4, bool))
    lengths = np.array([2, 0, 1, 2])
    b.put_generation(rows, (np.array([3, 4, 5, 6, EOS]), lengths), (np.array([-1, -2, -3, -4, -5.0]), lengths),
                     np.array([1, 2, 3, 4]), np.zeros(4, bool))
    sa, ma = a.snapshot()
    sb, mb = b.snapshot()
    assert ma == mb and all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert sa["response_versions"].tolist() == [1, 1, 3, 4, 4]
    assert a.rounds[:4].tolist() == [1, 1, 1, 1] and a.generated[1] and not a.complete[1]


def test_snapshot_restore_equal_state_and_behaviour(tmp_path):
    from safetensors.numpy import load_file, save_file

    dock = make_dock(gbs=2, n=2, max_split=3, max_tokens=9, max_model_len=20)
    load(dock, [0, 1, 2, 3])
    put(dock, dock.take_rows(), [3, 1, 3, 3, 1, 1, 2, 3], eos=[False, True, False, True, True, True, False, False])
    in_flight = dock.take_rows(limit=2)
    arrays, meta = dock.snapshot()
    save_file(arrays, str(tmp_path / "dock.safetensors"))
    meta = json.loads(json.dumps(meta))
    restored = TransferDock.restore(load_file(str(tmp_path / "dock.safetensors")), meta)
    again, meta_again = restored.snapshot()
    assert meta_again == meta and all(np.array_equal(arrays[k], again[k]) for k in arrays)
    assert restored.in_flight.sum() == 0 and dock.in_flight[in_flight].all()  # requests die with the process
    dock.release(in_flight)
    for d in (dock, restored):  # both continue the same way
        rows = d.take_rows()
        put(d, rows, 2, eos=True, version=7)
        d.select_batch()
    assert dock.batch_samples() == restored.batch_samples()
    assert dock.clear() == restored.clear()


def test_snapshot_with_a_selected_batch_and_bad_snapshots():
    dock = make_dock(gbs=1)
    load(dock, [0, 1])
    finish_groups(dock, [1])
    dock.select_batch()
    arrays, meta = dock.snapshot()
    restored = TransferDock.restore(arrays, meta)
    assert restored.select_batch().tolist() == [1] and restored.batch_group_ids().tolist() == [1]
    with pytest.raises(ValueError, match="format"):
        TransferDock.restore(arrays, {**meta, "format": "other"})
    with pytest.raises(ValueError, match="missing"):
        TransferDock.restore({k: v for k, v in arrays.items() if k != "age"}, meta)
    with pytest.raises(ValueError, match="shape"):
        TransferDock.restore({**arrays, "age": arrays["age"][:-1]}, meta)


def test_paged_columns_cross_pages_free_reuse_and_grow():
    store = PagedColumns(3, 20, {"v": np.int32}, page_size=4, initial_pages=2)
    store.append(np.array([0, 2]), np.array([3, 6]), {"v": np.arange(9)})
    store.append(np.array([2, 0, 1]), np.array([5, 2, 0]), {"v": np.arange(100, 107)})
    assert store.gather(np.array([0]), "v").tolist() == [0, 1, 2, 105, 106]
    assert store.gather(np.array([2, 1]), "v").tolist() == [3, 4, 5, 6, 7, 8, 100, 101, 102, 103, 104]
    used = store.n_pages - store.n_free
    store.free(np.array([2]))
    assert store.n_pages - store.n_free == used - 3 and store.length[2] == 0
    store.append(np.array([1]), np.array([20]), {"v": np.arange(20)})
    assert store.gather(np.array([1, 0]), "v").tolist() == list(range(20)) + [0, 1, 2, 105, 106]
    with pytest.raises(ValueError, match="max_len"):
        store.append(np.array([1]), np.array([1]), {"v": np.arange(1)})
