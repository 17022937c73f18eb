"""rollout.overlap through the real driver and dock on the simulated engine (the fake stands in for SGLang, which
cannot run here): requests left running when the dock is ready decode on through the update, pause for the swap in
each pause mode, and land in the dock at the next generate; the dock invariant holds as
tests/unit/test_scheduling_invariant.py checks it (every group trained once with its whole natural response, no
token lost, token_staleness_max <= max_age - 1)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import DEFAULT_EOS, LognormalLengths, TableLengths, simulated_prompt
from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.default_rollout import generate_training_batch
from spillover.rollout.drivers.rounds import DetachedRows
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest
from simulated_dock import check_trained_group, held_samples, load_iteration, token_staleness_max

PROMPT = 4
ITERATIONS = 8


@pytest.mark.parametrize("adopt", [False, True])
@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("max_age", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_keeps_the_dock_invariant(pause_mode, max_age, seed, adopt):
    cfg = RolloutConfig(global_batch_size=3, n_samples_per_prompt=3, max_tokens=48, max_model_len=48 + PROMPT,
                        max_split=2, mode="async", max_age=max_age, scheduling="length_aware", overlap=True,
                        over_sampling_groups=seed, adopt_detached=adopt)
    lengths = LognormalLengths(n=3, median=8, sigma=1.2, seed=seed, group_share=0.5)
    engine = SimulatedEngine(EngineTiming(2, 3, 0.01, 0.001, 0.0001), lengths, eos_token_id=DEFAULT_EOS,
                             pause_mode=pause_mode)
    dock, detached = TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()
    loaded, trained, tokens_trained, next_id, detached_tokens, mixed = [], Counter(), 0, 0, 0, 0
    for it in range(ITERATIONS):
        ids = load_iteration(dock, ITERATIONS, next_id, PROMPT)
        next_id += len(ids)
        loaded += ids
        stats = generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], it, drain=it == ITERATIONS - 1,
                                        detached=detached)
        detached_tokens += stats.detached_tokens
        batch = dock.batch_arrays()
        assert token_staleness_max(batch["weight_versions"], it) <= max_age - 1
        for g in dock.batch_group_ids().tolist():
            trained[g] += 1
            tokens_trained += check_trained_group(dock, g, lengths.group_lengths(g), cfg.max_tokens)
        versions, offsets = batch["weight_versions"], np.cumsum(batch["response_lengths"])[:-1]
        mixed += sum(len(set(v.tolist())) > 1 for v in np.split(versions, offsets))
        dock.clear(keep_generating=True)
        engine.advance(0.08)  # the learner's update: detached requests decode on ...
        engine.update_weights(None, it + 1, pause_s=0.02)  # ... and pause for the swap
    assert not dock.in_flight.any() and dock.stats()["loaded_groups"] == 0
    assert sorted(trained) == sorted(loaded) and set(trained.values()) == {1}
    assert engine.tokens_generated == tokens_trained  # no token lost, none twice
    assert detached_tokens > 0  # tokens were generated while the update ran
    if pause_mode == "in_place":
        assert mixed > 0  # some trained samples lived through an update: tokens of two versions


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
def test_detached_answers_land_at_the_next_generate(pause_mode):
    """Group 0 finishes first and is trained; group 1's rows run on through the update and are written, with the
    version of each token, when the next generate starts: that call needs no round."""
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=40, max_model_len=40 + PROMPT,
                        max_split=2, mode="async", max_age=3, overlap=True)
    engine = SimulatedEngine(EngineTiming(1, 4, 0.01, 0.0, 0.0), TableLengths({0: [2, 3], 1: [20, 20]}),
                             eos_token_id=DEFAULT_EOS, pause_mode=pause_mode)
    dock, detached = TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()
    dock.load_groups([0, 1], [simulated_prompt(g, PROMPT) for g in (0, 1)], [None, None])
    first = generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 0, drain=False, detached=detached)
    assert dock.batch_group_ids().tolist() == [0] and first.tokens_generated == 5
    assert dock.in_flight[2:4].all() and dock.responses.length[2:4].tolist() == [0, 0]
    dock.clear(keep_generating=True)
    engine.advance(0.05)                                # 5 more steps: 8 tokens each by now
    engine.update_weights(None, 1, pause_s=0.5)          # the swap: nothing decodes
    engine.advance(0.2)                                  # clear and checkpoint: 20 more steps
    second = generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 1, drain=False, detached=detached)
    versions = dock.batch_arrays()["weight_versions"].reshape(2, 20).tolist()
    if pause_mode == "abort":  # cut at the swap with 8 tokens each; the rest is generated by version 1 in a round
        assert second.detached_tokens == 16 and second.rounds == 1
        assert versions == [[0] * 8 + [1] * 12] * 2
    else:  # they finished during the clear: no round needed
        assert second.detached_tokens == 40 and second.rounds == 0
        assert versions == [[0] * 8 + [1] * 12] * 2
    assert dock.batch_group_ids().tolist() == [1]


class CollectFails(SimulatedEngine):
    """The simulated engine whose collection raises, as the fleet does when a detached request failed."""

    failing = False

    def collect_detached(self, adopt: bool = False):
        if self.failing:
            raise RuntimeError("a detached request failed")
        return super().collect_detached(adopt)


@pytest.mark.parametrize("adopt", [False, True])
def test_a_failed_collection_gives_the_detached_rows_back(adopt):
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=40, max_model_len=40 + PROMPT,
                        max_split=2, mode="async", max_age=3, overlap=True, adopt_detached=adopt)
    engine = CollectFails(EngineTiming(1, 4, 0.01, 0.0, 0.0), TableLengths({0: [2, 3], 1: [20, 20]}),
                          eos_token_id=DEFAULT_EOS)
    dock, detached = TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()
    dock.load_groups([0, 1], [simulated_prompt(g, PROMPT) for g in (0, 1)], [None, None])
    generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 0, drain=False, detached=detached)
    assert dock.in_flight[2:4].all()  # group 1 runs on, detached
    dock.clear(keep_generating=True)
    engine.failing = True
    with pytest.raises(RuntimeError, match="a detached request failed"):
        generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 1, drain=False, detached=detached)
    assert not dock.in_flight.any()  # nothing is left marked in flight: a retried step generates them again


@pytest.mark.parametrize("start_cutoff", [False, True])
def test_a_dock_ready_before_any_round_still_sends_its_rows_through_the_update(start_cutoff):
    """Over-sampled: group 1 finishes in the update, so the dock is ready as soon as the next call has collected it.
    That call still sends the fresh group 2, detached at once (no virtual time passes), and group 2 generates through
    the update under version 1. With rollout.start_cutoff the batch choice is now, so group 2 waits for the swap."""
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=40, max_model_len=40 + PROMPT,
                        max_split=2, mode="async", max_age=3, overlap=True, over_sampling_groups=1,
                        start_cutoff=start_cutoff)
    engine = SimulatedEngine(EngineTiming(1, 4, 0.01, 0.0, 0.0), TableLengths({0: [2, 3], 1: [20, 20], 2: [4, 4]}),
                             eos_token_id=DEFAULT_EOS)
    dock, detached = TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()

    def iteration(it: int, load: list[int]):
        dock.load_groups(load, [simulated_prompt(g, PROMPT) for g in load], [None] * len(load))
        start = engine.clock_s
        stats = generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], it, drain=False, detached=detached)
        took, group, versions = engine.clock_s - start, dock.batch_group_ids().tolist(), dock.batch_arrays()[
            "weight_versions"].tolist()
        dock.clear(keep_generating=True)
        engine.advance(0.3)                                # the update: 30 steps
        engine.update_weights(None, it + 1, pause_s=0.1)
        return stats, took, group, versions

    _, _, group, _ = iteration(0, [0, 1])
    assert group == [0]
    stats, took, group, _ = iteration(1, [2])
    assert group == [1] and took == 0.0 and stats.detached_tokens == 40
    stats, took, group, versions = iteration(2, [])
    assert group == [2]
    if start_cutoff:  # never sent at the ready point: a round under version 2 makes it
        assert stats.detached_tokens == 0 and stats.rounds == 1 and versions == [2] * 8
    else:  # made in the update under version 1, written at this call, no round needed
        assert stats.detached_tokens == 8 and stats.rounds == 0 and versions == [1] * 8


@pytest.mark.parametrize("adopt", [False, True])
def test_adopted_requests_run_on_into_the_next_step_without_a_second_prefill(adopt):
    """Group 1's rows still run when the next step starts: adopted (rollout.adopt_detached), they go on in that step's
    round with their KV (no prefill of prompt + partial response again); otherwise they are aborted and sent again."""
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=40, max_model_len=40 + PROMPT,
                        max_split=2, mode="async", max_age=3, overlap=True, adopt_detached=adopt)
    engine = SimulatedEngine(EngineTiming(1, 4, 0.01, 0.0, 0.001), TableLengths({0: [2, 3], 1: [20, 20], 2: [30, 30]}),
                             eos_token_id=DEFAULT_EOS)
    dock, detached = TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()
    dock.load_groups([0, 1], [simulated_prompt(g, PROMPT) for g in (0, 1)], [None, None])
    generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 0, drain=False, detached=detached)
    dock.clear(keep_generating=True)
    engine.advance(0.05)
    engine.update_weights(None, 1, pause_s=0.1)
    dock.load_groups([2], [simulated_prompt(2, PROMPT)], [None])
    second = generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], 1, drain=False, detached=detached)
    assert dock.batch_group_ids().tolist() == [1]
    versions = dock.batch_arrays()["weight_versions"].reshape(2, 20)
    assert (versions[:, 0] == 0).all() and (versions[:, -1] == 1).all()  # tokens of both versions, none lost
    if adopt:  # only group 2's rows were sent; group 1's two requests were taken over
        assert engine.continued_prefill_tokens == 0 and second.requests == 2 and second.adopted_requests == 2
    else:
        assert engine.continued_prefill_tokens > 0 and second.requests == 4 and second.adopted_requests == 0


def test_a_checkpoint_taken_while_adopted_requests_run_resumes_every_group_once_within_the_bound():
    """A kill -9 after the checkpoint of a step whose adopted requests still ran (rollout.adopt_detached): the snapshot
    holds their rows as not in flight, with the tokens the dock had then and the age their group got at adoption (at
    least the staleness of the tokens still on their way); the resumed run (the dock from the snapshot, new engines,
    nothing detached) generates those rows on from their stored tokens and trains every group once, whole, within the
    bound."""
    cfg = RolloutConfig(global_batch_size=3, n_samples_per_prompt=3, max_tokens=48, max_model_len=48 + PROMPT,
                        max_split=2, mode="async", max_age=3, scheduling="length_aware", overlap=True,
                        over_sampling_groups=1, adopt_detached=True)
    lengths = LognormalLengths(n=3, median=8, sigma=1.2, seed=0, group_share=0.5)

    def engines_at(version: int) -> SimulatedEngine:
        engine = SimulatedEngine(EngineTiming(2, 3, 0.01, 0.001, 0.0001), lengths, eos_token_id=DEFAULT_EOS,
                                 pause_mode="in_place")
        engine.update_weights(None, version)
        return engine

    engine, dock, detached = engines_at(0), TransferDock.from_config(cfg, [DEFAULT_EOS]), DetachedRows()
    loaded, trained, next_id, crashed_after = [], Counter(), 0, None
    for it in range(ITERATIONS):
        ids = load_iteration(dock, ITERATIONS, next_id, PROMPT)
        next_id += len(ids)
        loaded += ids
        generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], it, drain=it == ITERATIONS - 1, detached=detached)
        assert token_staleness_max(dock.batch_arrays()["weight_versions"], it) <= cfg.max_age - 1
        for g in dock.batch_group_ids().tolist():
            trained[g] += 1
            check_trained_group(dock, g, lengths.group_lengths(g), cfg.max_tokens)
        dock.clear(keep_generating=True)
        engine.advance(0.08)
        engine.update_weights(None, it + 1, pause_s=0.02)
        if crashed_after is None and dock.adopted.any():  # the step's checkpoint, then the kill
            arrays, meta = dock.snapshot()
            adopted_groups = np.unique(np.flatnonzero(dock.adopted) // dock.n)
            restored = TransferDock.restore(arrays, json.loads(json.dumps(meta)), "checkpoint")
            assert not restored.in_flight.any() and not restored.adopted.any()
            assert (restored.group_age()[adopted_groups] == dock.group_age()[adopted_groups]).all()
            assert (restored.group_age()[adopted_groups] >= 2).all()  # a version at adoption, one at this clear
            dock, engine, detached, crashed_after = restored, engines_at(it + 1), DetachedRows(), it
            engine.claim_samples(held_samples(dock, lengths))  # the simulator's draws: a row keeps its sample
    assert crashed_after is not None and crashed_after < ITERATIONS - 2  # the resumed run went on for steps
    assert not dock.in_flight.any() and dock.stats()["loaded_groups"] == 0
    assert sorted(trained) == sorted(loaded) and set(trained.values()) == {1}


def test_retract_recomputes_the_kv_and_in_place_does_not():
    def run(mode: str) -> SimulatedEngine:
        engine = SimulatedEngine(EngineTiming(1, 4, 0.01, 0.0, 0.001), TableLengths({0: [2, 30]}),
                                 eos_token_id=DEFAULT_EOS, pause_mode=mode)
        jobs = [GenerateJob(GenerateRequest(input_ids=simulated_prompt(0, PROMPT),
                                            sampling_params={"max_new_tokens": 40}))] * 2
        answers = engine.generate(jobs, on_result=lambda i, a: True, detach=True)
        assert answers[1] is None and answers[0].meta_info.finish_reason.type == "stop"
        engine.advance(0.1)
        engine.update_weights(None, 1, pause_s=1.0)
        engine.advance(1.0)
        late = engine.collect_detached()
        assert list(late) == [1] and late[1].meta_info.finish_reason.type == "stop"
        assert late[1].meta_info.weight_versions[-1].version == 1
        assert engine.collect_detached() == {}
        return engine

    retract, in_place = run("retract"), run("in_place")
    assert in_place.recomputed_prefill_tokens == 0
    assert retract.recomputed_prefill_tokens == PROMPT + 12  # prompt + the 12 tokens made before the pause
    assert retract.clock_s == in_place.clock_s  # the answers wait for collect either way


def test_a_new_generate_before_collecting_is_refused():
    engine = SimulatedEngine(EngineTiming(1, 4, 0.01, 0.0, 0.0), TableLengths({0: [2, 30]}), eos_token_id=DEFAULT_EOS)
    jobs = [GenerateJob(GenerateRequest(input_ids=simulated_prompt(0, PROMPT), sampling_params={"max_new_tokens": 40}))]
    engine.generate(jobs * 2, on_result=lambda i, a: True, detach=True)
    with pytest.raises(RuntimeError, match="collect_detached"):
        engine.generate(jobs)
