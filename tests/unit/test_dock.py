"""The transfer dock's rules (rollout/dock/transfer_dock.py), one test per rule, on small docks: loading, generation
and its checks, the paged columns. The batch, clear, drain and snapshot rules: test_dock_batch.py."""
from __future__ import annotations

import numpy as np
import pytest
from dock_helpers import EOS, finish_groups, load, make_dock, put

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.batch import to_samples
from spillover.rollout.dock.transfer_dock import DockError, TransferDock
from spillover.rollout.dock.buffers import PagedColumns
from spillover.rollout.sample import Status


def test_capacity_and_free_slots_2gbs_then_gbs():
    dock = make_dock(gbs=3, n=2, max_split=4)
    assert dock.partial and dock.capacity_groups == 6 and dock.capacity_rows == 12
    assert dock.free_group_slots() == 6
    slots = load(dock, range(6))
    assert slots.tolist() == list(range(6))
    assert dock.free_group_slots() == 0  # full
    finish_groups(dock, [0, 1, 2])
    dock.select_batch()
    dock.clear()
    assert dock.free_group_slots() == 3  # the trained GBS groups left
    plain = make_dock(gbs=3, max_split=1)
    assert not plain.partial and plain.capacity_groups == 3
    assert plain.free_group_slots() == 3


def test_from_config():
    cfg = RolloutConfig(global_batch_size=4, n_samples_per_prompt=3, max_split=2, max_tokens=16, max_model_len=40,
                        require_max_age_all_finished=True)
    dock = TransferDock.from_config(cfg, [7, 8])
    assert (dock.gbs, dock.n, dock.capacity_groups, dock.max_age, dock.max_tokens // dock.max_split) == (4, 3, 8, 2, 8)
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
    ids, max_new = dock.generation_inputs(rows, dock.max_tokens // dock.max_split)
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
    statuses = [s.status for s in to_samples(dock.rollout_batch())[0]]
    assert statuses == [Status.COMPLETED, Status.TRUNCATED, Status.TRUNCATED, Status.COMPLETED]


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
