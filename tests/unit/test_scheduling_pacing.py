"""Start pacing and the start cutoff (issue 38: rollout.start_groups_per_step, rollout.start_cutoff): which rows go,
which wait unstarted, that waiting never stalls a generation step, and that a cutoff group does not start in the
update (the simulated engine and the driver loop)."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import DEFAULT_EOS, TableLengths, simulated_prompt
from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.dispatch import DispatchPlanner
from spillover.rollout.drivers.requests import SamplingSettings, build_requests, parse_responses
from spillover.rollout.drivers.scheduling import hold_fresh_beyond, plan_dispatch

# one engine, eight slots, one second per step, nothing else costs
UNIT = EngineTiming(num_engines=1, slots_per_engine=8, step_base_s=1.0, step_per_seq_s=0.0, prefill_per_token_s=0.0)


def _generate(dock, engine, rows, round_tokens=None):
    inputs, max_new = dock.generation_inputs(rows, round_tokens)
    requests = DispatchPlanner.route(build_requests(inputs, max_new, SamplingSettings()), None)
    tokens, logprobs, stopped, version = parse_responses(engine.generate(requests), 0)
    dock.put_generation(rows, tokens, logprobs, version, stopped)


def _dock(groups: int = 3):
    """n = 2; group 0 (rows 0, 1) finished at 6 tokens each (the prior: 6); group 1's row 2 carried with 1 token, its
    row 3 not sent yet; groups 2.. fresh. Every group is at age 0. -> dock with rows 2.. waiting."""
    dock = TransferDock(groups, 2, 2, 12, 16, [DEFAULT_EOS], max_age=3)
    dock.load_groups(list(range(groups)), [simulated_prompt(g, 3) for g in range(groups)], [None] * groups)
    engine = SimulatedEngine(UNIT, TableLengths({g: [6, 6] if g == 0 else [8, 8] for g in range(groups)}))
    rows = dock.take_rows()
    dock.release(rows[rows >= 2])
    _generate(dock, engine, np.array([0, 1]))
    rows = dock.take_rows(limit=1)
    assert rows.tolist() == [2]
    _generate(dock, engine, rows, round_tokens=1)
    assert dock.responses.length[:4].tolist() == [6, 6, 1, 0]
    return dock


def test_hold_fresh_beyond_keeps_the_first_groups_in_the_given_order():
    groups = np.array([5, 5, 3, 3, 7, 7, 9])
    fresh = np.array([False, False, True, True, True, True, True])
    assert hold_fresh_beyond(groups, fresh, 1).tolist() == [False, False, False, False, True, True, True]
    assert hold_fresh_beyond(groups, fresh, 0).tolist() == fresh.tolist()  # started groups are never held
    assert not hold_fresh_beyond(groups, fresh, None).any()
    assert not hold_fresh_beyond(groups, fresh, 3).any()


def test_start_pacing_sets_fresh_groups_aside_beyond_the_limit():
    dock = _dock(groups=4)  # group 1 started (row 2 holds a token); groups 2 and 3 fresh, loaded in that order
    rows = dock.take_rows()
    sent, _, aside = plan_dispatch(dock, rows, "length_aware", fresh_limit=1)
    assert sorted(sent.tolist()) == [2, 3, 4, 5] and aside.tolist() == [6, 7]  # group 2 loaded first goes
    sent, _, aside = plan_dispatch(dock, rows, "length_aware", fresh_limit=0)
    assert sorted(sent.tolist()) == [2, 3] and sorted(aside.tolist()) == [4, 5, 6, 7]
    sent, _, aside = plan_dispatch(dock, rows, "length_aware")
    assert len(sent) == 6 and len(aside) == 0


def test_planner_spends_the_allowance_once_per_step_and_never_stalls():
    dock = _dock(groups=4)
    cfg = RolloutConfig(global_batch_size=4, n_samples_per_prompt=2, max_tokens=12, max_model_len=16,
                        scheduling="length_aware", start_groups_per_step=1)

    class OneEngine:
        num_engines = 1

    planner = DispatchPlanner.from_config(cfg, OneEngine(), 0, drain=False)
    rows, _ = planner.next_rows(dock)
    assert sorted(rows.tolist()) == [2, 3, 4, 5] and planner.fresh_left == 0
    assert dock.in_flight[6:8].all()  # held rows stay in flight: no round hands them out again
    rows, _ = planner.next_rows(dock)  # nothing else left: the held group goes rather than stall the step
    assert sorted(rows.tolist()) == [6, 7]
    planner.release_held(dock)


def test_pacing_settings_need_their_modes():
    with pytest.raises(ValidationError, match="start_groups_per_step"):
        RolloutConfig(start_groups_per_step=8)
    defaults = RolloutConfig()
    assert defaults.start_groups_per_step is None and defaults.start_cutoff is False


def _overlap_step(start_cutoff: bool) -> int:
    """gbs 1, n 2, one engine with three slots, one second per token. Groups 0 (rows of 1 and 1 token), 1 (2 and 5)
    and 2 (3 and 3) go out in load order: group 0 and group 1's first row take the slots, and group 0 makes the dock
    ready at t = 1 s with group 1's second row and group 2 still queued. During the update (2 s) group 1's first row
    ends at t = 2 s and frees slots. -> group 2's tokens made by the old weights (version 0)."""
    from spillover.rollout.drivers.rounds import DetachedRows, generate_rounds

    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=8, max_model_len=12, mode="async",
                        overlap=True, scheduling="length_aware", max_age=3, over_sampling_groups=1,
                        start_cutoff=start_cutoff)
    dock = TransferDock.from_config(cfg, [DEFAULT_EOS])
    dock.load_groups([0, 1, 2], [simulated_prompt(g, 3) for g in (0, 1, 2)], [None] * 3)
    engine = SimulatedEngine(EngineTiming(1, 3, 1.0, 0.0, 0.0), TableLengths({0: [1, 1], 1: [2, 5], 2: [3, 3]}))
    detached, sampling = DetachedRows(), SamplingSettings.from_rollout(cfg, [DEFAULT_EOS])
    generate_rounds(dock, engine, cfg, sampling, 0, detached=detached)
    assert dock.group_ids[dock.select_batch()].tolist() == [0]
    dock.clear(keep_generating=True)
    engine.advance(2.0)  # the update: what runs decodes on, and freed slots take queued requests
    engine.update_weights(None, 1)
    generate_rounds(dock, engine, cfg, sampling, 1, detached=detached)  # collects the update's answers first
    group2 = np.flatnonzero(np.repeat(dock.group_ids == 2, dock.n))
    return int((dock.responses.gather(group2, "versions") == 0).sum())


def test_start_cutoff_keeps_groups_not_started_by_the_choice_out_of_the_update():
    assert _overlap_step(start_cutoff=False) == 2  # group 2 started in the update: one old token per row
    assert _overlap_step(start_cutoff=True) == 0   # it waited unstarted and ran under the new weights


def test_start_cutoff_needs_overlap():
    with pytest.raises(ValidationError, match="start_cutoff"):
        RolloutConfig(start_cutoff=True, mode="async", scheduling="length_aware")


def test_adopt_detached_needs_overlap():
    with pytest.raises(ValidationError, match="adopt_detached"):
        RolloutConfig(adopt_detached=True, mode="async")
