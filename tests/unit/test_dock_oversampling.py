"""Over-sampling in the transfer dock (slime's over_sampling_batch_size, APRIL): more groups than GBS are
loaded and dispatched, generation stops at GBS ready groups, and the surplus stays for the next iteration."""
from __future__ import annotations

import numpy as np
import pytest

from dock_helpers import group_order
from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.tasks.prompts import groups_for_iteration

EOS = 0


def make_dock(gbs=2, n=2, max_split=1, extra=1, **kw) -> TransferDock:
    return TransferDock(gbs, n, max_split, 8, 16, [EOS], over_sampling_groups=extra, **kw)


def load(dock: TransferDock, ids) -> np.ndarray:
    return dock.load_groups(np.asarray(ids), [[100 + g, 3] for g in ids], [g for g in ids])


def answer(dock: TransferDock, rows, length: int, eos: bool, version: int = 0) -> None:
    tokens = [[5] * (length - 1) + [EOS if eos else 5] for _ in rows]
    dock.put_generation(np.asarray(rows), tokens, [[-0.5] * length for _ in rows], version, [False] * len(rows))


def test_capacity_and_loads_count_the_extra_groups():
    plain = make_dock(gbs=3, extra=2)
    assert not plain.partial and plain.capacity_groups == 5 and plain.capacity_rows == 10
    assert plain.free_group_slots() == 5
    partial = make_dock(gbs=3, max_split=2, extra=2)
    assert partial.capacity_groups == 8 and partial.free_group_slots() == 8
    assert make_dock(gbs=3, extra=0).capacity_groups == 3  # the default: no over-sampling
    cfg = RolloutConfig(global_batch_size=4, n_samples_per_prompt=2, max_split=1, over_sampling_groups=3)
    assert TransferDock.from_config(cfg, [EOS]).capacity_groups == 7


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_bad_over_sampling_groups_is_refused(bad):
    with pytest.raises(ValueError, match="over_sampling_groups"):
        make_dock(extra=bad)


def test_stop_at_gbs_and_the_surplus_stays_with_its_tokens():
    dock = make_dock(gbs=2, n=2, extra=2)
    load(dock, range(4))
    rows = dock.take_rows()  # every row is dispatched, not only GBS x n
    assert len(rows) == 8
    # groups 1 and 3 finish; group 0 gets 3 tokens of one row before the abort, group 2 nothing
    answer(dock, [2, 3, 6, 7], 2, eos=True)
    assert dock.update_ready() and dock.ready_group_count() == 2
    answer(dock, [0], 3, eos=False)
    dock.release([1, 4, 5])
    assert dock.select_batch().tolist() == [1, 3]
    dock.clear()
    assert dock.stats()["loaded_groups"] == 2 and dock.responses.length[0] == 3 and dock.age[0] == 1
    assert dock.free_group_slots() == 2
    load(dock, [4, 5])
    # the carried-over rows go first: group 0 (age 1), then group 2, then the new groups
    assert dock.take_rows(limit=4).tolist() == [0, 1, 4, 5]
    inputs, max_new = dock.generation_inputs(np.array([0]), None)
    assert inputs[0] == [100, 3, 5, 5, 5] and max_new.tolist() == [5]  # continued from its tokens


def test_a_ready_surplus_group_is_trained_next_iteration():
    dock = make_dock(gbs=1, n=2, extra=1)
    load(dock, [0, 1])
    answer(dock, dock.take_rows(), 1, eos=True)
    assert dock.ready_group_count() == 2
    assert dock.group_ids[dock.select_batch()].tolist() == [0]
    dock.clear()
    load(dock, [2])
    assert dock.update_ready() and dock.group_ids[dock.select_batch()].tolist() == [1]


def test_snapshot_keeps_the_over_sampling_capacity():
    dock = make_dock(gbs=2, extra=3)
    load(dock, range(5))
    arrays, meta = dock.snapshot()
    restored = TransferDock.restore(arrays, meta, "a snapshot in memory")
    assert restored.over_sampling_groups == 3 and restored.capacity_groups == 5
    assert restored.group_ids.tolist() == dock.group_ids.tolist()


@pytest.mark.parametrize("max_split,extra", [(1, 0), (2, 0), (1, 1), (2, 1), (1, 3), (2, 3), (4, 2)])
@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
def test_a_run_loads_and_trains_exactly_iterations_x_gbs_groups(max_split, extra, iterations):
    gbs, n = 3, 2
    dock = TransferDock(gbs, n, max_split, 8, 16, [EOS], over_sampling_groups=extra)
    next_id, trained = 0, []
    for it in range(iterations):
        count = groups_for_iteration(dock, iterations)
        load(dock, range(next_id, next_id + count))
        next_id += count
        dock.set_drain(it == iterations - 1)
        assert dock.stats()["loaded_groups"] >= gbs
        # finish the oldest gbs groups' rows (the others may be left half-done: they stay)
        order = group_order(dock)[:gbs]
        rows = (order[:, None] * n + np.arange(n)).reshape(-1)
        dock.in_flight[rows] = True
        answer(dock, rows, 1, eos=True)
        if it == iterations - 1:
            assert dock.stats()["loaded_groups"] == gbs  # the last iteration drains exactly GBS groups
        assert dock.update_ready()
        trained += dock.group_ids[dock.select_batch()].tolist()
        dock.clear()
    assert next_id == iterations * gbs and sorted(trained) == list(range(iterations * gbs))


class CountingEngine:
    """A simulated engine (bench/simulator/engine.py) that records how many requests each round sent."""

    num_engines = 1  # rows are only ordered, never pinned

    def __init__(self, lengths):
        from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
        from spillover.bench.simulator.workload import TableLengths

        self.engine = SimulatedEngine(EngineTiming(num_engines=1, slots_per_engine=64), TableLengths(lengths), EOS)
        self.rounds: list[int] = []

    def generate(self, requests, on_result=None):
        self.rounds.append(len(requests))
        return self.engine.generate(requests, on_result)


@pytest.mark.parametrize("max_split", [1, 2])
def test_sync_rounds_dispatch_the_over_sampled_groups_from_the_first_round(max_split):
    """README: the K extra groups are loaded and dispatched (APRIL) -- in sync mode too, not only once earlier
    rows finish: the first round sends (GBS + K) x n requests."""
    from spillover.bench.simulator.workload import simulated_prompt
    from spillover.rollout.drivers.rounds import generate_rounds
    from spillover.rollout.drivers.requests import SamplingSettings

    gbs, n, extra = 2, 2, 2
    cfg = RolloutConfig(global_batch_size=gbs, n_samples_per_prompt=n, max_split=max_split, max_tokens=8,
                        max_model_len=16, over_sampling_groups=extra)
    dock = TransferDock.from_config(cfg, [EOS])
    count = dock.free_group_slots()
    dock.load_groups(np.arange(count), [simulated_prompt(g, 4) for g in range(count)], list(range(count)))
    engine = CountingEngine({g: [2, 3] for g in range(count)})  # every response ends in the first round
    generate_rounds(dock, engine, cfg, SamplingSettings(stop_token_ids=[EOS]), weight_version=0)
    assert engine.rounds == [(gbs + extra) * n]
    assert dock.ready_group_count() == gbs + extra  # the surplus is complete and waits for the next batch
