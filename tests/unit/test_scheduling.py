"""Length-aware dispatch (rollout/drivers/scheduling.py, rollout/drivers/dispatch.py): the estimate on hand-computed dock
states, engine balancing, tail batching's split, the simulator's prediction on a tiny workload (fifo vs
length_aware), and the estimate's independence from responses not yet generated."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.rollout.drivers.dispatch import DispatchPlanner
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import DEFAULT_EOS, TableLengths, simulated_prompt
from spillover.rollout.drivers.requests import SamplingSettings, build_requests, parse_responses
from spillover.rollout.drivers.scheduling import (balance_engines, expected_remaining, longest_first, plan_dispatch,
                                reserve_tail_engines, split_tail)

# one engine, two slots, one second per step, nothing else costs: a request of L tokens takes L seconds
UNIT = EngineTiming(num_engines=1, slots_per_engine=2, step_base_s=1.0, step_per_seq_s=0.0, prefill_per_token_s=0.0)


def test_expected_remaining_hand_computed():
    # group 0: rows 0,1 finished (10, 30), row 2 carried with 5 tokens, row 3 fresh; group 1: fresh + one carried
    lengths = np.array([10, 30, 5, 0, 0, 0, 0, 12])
    complete = np.array([True, True, False, False, False, False, False, False])
    rows = np.array([2, 3, 4, 7])
    room = np.full(4, 100)
    est = expected_remaining(lengths, complete, room, 4, rows)
    # prior = mean finished length 20; siblings: at least the longest finished one (30); carried: >= 2 x L
    assert est.tolist() == [25.0, 30.0, 20.0, 12.0]
    assert expected_remaining(lengths, complete, np.array([7, 100, 100, 3]), 4, rows).tolist() == [7.0, 30.0, 20.0, 3.0]
    assert longest_first(est).tolist() == [1, 0, 2, 3]
    assert longest_first(est, ages=np.array([0, 0, 0, 1])).tolist() == [3, 1, 0, 2]  # older groups first


def test_balance_engines_levels_loads_and_spreads_a_group():
    est = np.array([8.0, 8, 8, 8, 4, 4, 2, 2])
    engine = balance_engines(est, np.array([0, 0, 0, 0, 1, 1, 2, 2]), num_engines=4)
    assert sorted(engine[:4].tolist()) == [0, 1, 2, 3]  # one row of group 0 on each engine
    loads = np.bincount(engine, weights=est, minlength=4)
    assert loads.max() - loads.min() <= est.max()
    assert balance_engines(est, np.zeros(8, dtype=int), num_engines=1).tolist() == [0] * 8
    # loads already there count: the idle engine takes the first row
    assert balance_engines(np.array([5.0]), np.array([0]), loads=np.array([9.0, 0.0, 3.0])).tolist() == [1]


def test_split_tail_sets_aside_only_far_longer_rows_that_can_wait():
    est = np.array([1.0, 1, 1, 10])
    assert split_tail(est, np.zeros(4), max_age=4, factor=4.0).tolist() == [False, False, False, True]
    assert not split_tail(est, np.array([0, 0, 0, 2]), max_age=4, factor=4.0).any()  # its deadline is near
    assert not split_tail(est, np.zeros(4), max_age=4, factor=0.0).any()  # off


def _dock_with_a_carried_row(lengths):
    """Group 1 loaded first (older in the dock's order), group 0 second; one round of 2 tokens for group 0
    only: its first sample (1 token) finishes, its second stops at 2 tokens (carried). -> dock, engine."""
    dock = TransferDock(2, 2, 1, 8, 12, [DEFAULT_EOS], max_age=2)
    dock.load_groups([1, 0], [simulated_prompt(1, 3), simulated_prompt(0, 3)], [None, None])
    engine = SimulatedEngine(UNIT, TableLengths(lengths))
    rows = dock.take_rows()
    dock.release(rows[rows // 2 == 0])  # group 1's rows (slot 0) wait
    group0 = rows[rows // 2 == 1]
    _generate(dock, engine, group0, 2)
    return dock, engine


def _generate(dock, engine, rows, round_tokens=None, engines=None):
    inputs, max_new = dock.generation_inputs(rows, round_tokens)
    requests = DispatchPlanner.route(build_requests(inputs, max_new, SamplingSettings()), engines)
    tokens, logprobs, stopped, version = parse_responses(engine.generate(requests), 0)
    dock.put_generation(rows, tokens, logprobs, version, stopped)


@pytest.mark.parametrize("scheduling, makespan_s", [("fifo", 6.0), ("length_aware", 5.0)])
def test_simulator_prediction_tiny_workload(scheduling, makespan_s):
    # left: group 1's two fresh 1-token rows and group 0's carried row (5 tokens to go). fifo sends group 1
    # first (it is older): both slots finish at t=1, then the long row runs 5 steps -> 6 s. length_aware sends
    # the carried row first (expected 2 x 2 - 2 = 2 > prior 1): it runs 0..5 beside the short ones -> 5 s.
    dock, engine = _dock_with_a_carried_row({0: [1, 7], 1: [1, 1]})
    assert engine.clock_s == 2.0
    rows = dock.take_rows()
    assert rows.tolist() == [0, 1, 3]
    ordered, engines, aside = plan_dispatch(dock, rows, scheduling)
    assert ordered.tolist() == ([0, 1, 3] if scheduling == "fifo" else [3, 0, 1]) and engines is None
    _generate(dock, engine, ordered)
    assert engine.clock_s - 2.0 == makespan_s
    assert dock.complete.all()


def test_the_estimate_never_reads_a_response_not_yet_generated():
    # two futures that agree on everything generated so far (the finished sample, the carried row's 2 tokens)
    # but not on how long the carried row and the fresh ones will be: the same plan, the same estimate
    plans = []
    for future in ({0: [1, 7], 1: [1, 1]}, {0: [1, 3], 1: [6, 2]}):
        dock, _ = _dock_with_a_carried_row(future)
        rows = dock.take_rows()
        est = expected_remaining(dock.responses.length, dock.complete, dock.max_new_tokens(rows, None), dock.n, rows)
        ordered, engines, _ = plan_dispatch(dock, rows, "length_aware", num_engines=2)
        plans.append((est.tolist(), ordered.tolist(), engines.tolist()))
    assert plans[0] == plans[1]
    # and the estimate reads lengths and flags only: scrambling the generated token values changes nothing
    dock, _ = _dock_with_a_carried_row({0: [1, 7], 1: [1, 1]})
    rows = dock.take_rows()
    before = plan_dispatch(dock, rows, "length_aware", num_engines=2)
    dock.responses.columns["tokens"][:] = 12345
    after = plan_dispatch(dock, rows, "length_aware", num_engines=2)
    assert all(np.array_equal(a, b) for a, b in zip(before[:2], after[:2]))


def test_pinned_requests_queue_on_their_engine():
    engine = SimulatedEngine(EngineTiming(2, 1, 1.0, 0.0, 0.0), TableLengths({0: [3, 3], 1: [3, 3]}))
    requests = build_requests([simulated_prompt(0, 3)] * 2 + [simulated_prompt(1, 3)] * 2, np.full(4, 8),
                              SamplingSettings())
    engine.generate(DispatchPlanner.route(requests, np.array([0, 0, 1, 1])))
    assert engine.clock_s == 6.0  # two 3-token rows one after the other on each engine (one slot each)
    assert engine.usage()["engine_busy_s"] == 12.0


def test_unknown_scheduling_is_refused():
    dock, _ = _dock_with_a_carried_row({0: [1, 7], 1: [1, 1]})
    with pytest.raises(ValueError, match="rollout.scheduling"):
        plan_dispatch(dock, dock.take_rows(), "shortest_first")


def test_tail_rows_get_the_reserved_engines():
    est = np.array([100.0, 90, 10, 10, 10, 10, 10, 10])
    groups = np.arange(8)
    engines = reserve_tail_engines(est, groups, num_engines=4, tail_engines=1, factor=4.0)
    assert engines[:2].tolist() == [3, 3] and set(engines[2:].tolist()) == {0, 1, 2}
    assert np.bincount(engines[2:], minlength=3).tolist() == [2, 2, 2]


def test_correlated_lengths_keep_the_marginal_and_tie_a_group_together():
    from spillover.bench.simulator.workload import LognormalLengths

    groups = [LognormalLengths(16, 100.0, 1.0, seed=3, group_share=0.8).group_lengths(g) for g in range(400)]
    logs = np.log(np.stack(groups).astype(float))
    assert abs(np.median(np.exp(logs)) - 100) < 15 and abs(logs.std() - 1.0) < 0.1
    assert logs.mean(axis=1).std() > 0.8  # group means spread: most of the variance is the prompt's
    independent = np.log(np.stack([LognormalLengths(16, 100.0, 1.0, seed=3).group_lengths(g) for g in range(400)]))
    assert independent.mean(axis=1).std() < 0.4
