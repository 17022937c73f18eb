"""The simulated engine (bench/simulator/engine.py): its timing model on hand-computed cases, abort
semantics, SGLang answer shapes, and a small long-tail run through the real dock and driver loop."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.batch import to_samples
from spillover.rollout.dock.transfer_dock import TransferDock
from simulated_dock import token_staleness_max
from spillover.rollout.sglang.protocol import FinishReason, GenerateJob, GenerateRequest, GenerateResponse
from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import (DEFAULT_EOS, FILL_TOKEN, SAMPLE_KEY_BASE, LognormalLengths,
                                                TableLengths, answer, parse_simulated_input, simulated_prompt)
from spillover.rollout.drivers.rounds import generate_rounds
from spillover.rollout.drivers.requests import SamplingSettings, parse_responses
from spillover.tasks.prompts import groups_for_iteration

EOS = DEFAULT_EOS
# one engine, 2 slots: a step costs 10 ms + 1 ms per running request; prefill 0.1 ms per input token
TINY = EngineTiming(num_engines=1, slots_per_engine=2, step_base_s=0.010, step_per_seq_s=0.001,
                    prefill_per_token_s=0.0001)


def request(ids, max_new=10, rid=None) -> GenerateJob:
    return GenerateJob(GenerateRequest(input_ids=list(ids), sampling_params={"max_new_tokens": max_new},
                                       return_logprob=True, rid=rid or f"r{len(ids)}-{max_new}"))


def engine(table, timing=TINY) -> SimulatedEngine:
    return SimulatedEngine(timing, TableLengths(table))


def test_prompts_name_their_group_and_continuations_their_sample():
    prompt = simulated_prompt(41, 5)
    assert parse_simulated_input(prompt) == (41, 5, None)
    assert parse_simulated_input(prompt + [SAMPLE_KEY_BASE + 3, FILL_TOKEN]) == (41, 5, 3)
    with pytest.raises(ValueError, match="simulated_prompt"):
        parse_simulated_input([1, 2, 3, 4])


def test_two_requests_in_two_slots_hand_computed():
    eng = engine({0: [3, 5]})
    done = []
    out = eng.generate([request(simulated_prompt(0, 4))] * 2, on_result=lambda i, r: done.append((i, eng.clock_s)))
    # t=0: both admitted, prefill 8 tokens = 0.8 ms; steps of 12 ms (2 running): 3 tokens at 36.8 ms,
    # then 11 ms steps (1 running): tokens 4 and 5 at 47.8 and 58.8 ms
    assert done == [(0, pytest.approx(0.0368)), (1, pytest.approx(0.0588))]
    assert eng.clock_s == pytest.approx(0.0588)
    first, second = out
    assert first.output_ids == [SAMPLE_KEY_BASE + 0, FILL_TOKEN, EOS]
    assert second.output_ids == [SAMPLE_KEY_BASE + 1, FILL_TOKEN, FILL_TOKEN, FILL_TOKEN, EOS]
    assert first.meta_info.finish_reason.type == "stop" and first.meta_info.completion_tokens == 3
    usage = eng.usage()
    assert usage["engine_busy_s"] == pytest.approx(0.0588)
    assert usage["slot_busy_s"] == pytest.approx(2 * 0.0368 + 0.022)
    assert usage["tokens_generated"] == 8 and usage["prefill_tokens"] == 8


def test_a_queued_request_takes_the_freed_slot_and_pays_its_prefill():
    eng = engine({0: [3, 5], 1: [2]})
    done = {}
    eng.generate([request(simulated_prompt(0, 4))] * 2 + [request(simulated_prompt(1, 4))],
                 on_result=lambda i, r: done.setdefault(i, eng.clock_s))
    # at 36.8 ms request 2 enters: its step costs 12 ms + 0.4 ms prefill -> 49.2; then 61.2 ms: both end
    # (request 1 had 3 + 2 = 5 tokens, request 2 had 2)
    assert done[0] == pytest.approx(0.0368)
    assert done[1] == pytest.approx(0.0612) and done[2] == pytest.approx(0.0612)


def test_engines_run_on_their_own_clocks_and_first_fill_is_round_robin():
    timing = EngineTiming(num_engines=2, slots_per_engine=1, step_base_s=0.010, step_per_seq_s=0.0,
                          prefill_per_token_s=0.0)
    eng = engine({0: [2, 7], 1: [1]}, timing)
    done = {}
    eng.generate([request(simulated_prompt(0, 3))] * 2 + [request(simulated_prompt(1, 3))],
                 on_result=lambda i, r: done.setdefault(i, eng.clock_s))
    # engine 0 runs request 0 (2 tokens, 20 ms) then the queued request 2 (1 token, 30 ms);
    # engine 1 runs request 1 (7 tokens, 70 ms)
    assert done == {0: pytest.approx(0.02), 2: pytest.approx(0.03), 1: pytest.approx(0.07)}
    assert eng.usage()["engine_busy_s"] == pytest.approx(0.03 + 0.07)


def test_budget_limits_and_eos_on_the_last_position_reports_stop():
    eng = engine({0: [4, 9]})
    out = eng.generate([request(simulated_prompt(0, 3), max_new=4), request(simulated_prompt(0, 3), max_new=4)])
    # SGLang 0.5.23 (../shared/sglang-contract): an EOS on the last allowed position is a stop, token included
    assert out[0].output_ids[-1] == EOS and len(out[0].output_ids) == 4
    assert out[0].meta_info.finish_reason == FinishReason(type="stop", matched=EOS)
    assert out[1].output_ids[-1] == FILL_TOKEN
    assert out[1].meta_info.finish_reason == FinishReason(type="length", length=4)
    assert eng.generate([request(simulated_prompt(5, 3), max_new=0)])[0].output_ids == []  # answered at once
    for reply in out:
        assert GenerateResponse.model_validate_json(reply.model_dump_json()) == reply  # as the client parses it
        assert [e[1] for e in reply.meta_info.output_token_logprobs] == reply.output_ids


def test_the_dock_counts_an_eos_on_the_last_position_as_stopped_however_it_is_reported():
    """Engine answer -> parse_responses -> dock: the truncated flag (truncated_share, Sample.status) is "complete
    without a stop"; an EOS at the budget's last position is a stop whether the engine says stop (SGLang 0.5.23,
    the engines here) or length (older engines): the dock also checks the last token against its EOS ids."""
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=4, max_model_len=12, max_split=1)
    dock = TransferDock.from_config(cfg, [EOS])
    dock.load_groups([0], [simulated_prompt(0, 4)], [0])
    generate_rounds(dock, engine({0: [4, 9]}), cfg, SamplingSettings(stop_token_ids=[EOS]), weight_version=0)
    dock.select_batch()
    assert dock.batch_arrays()["truncated"].tolist() == [False, True]
    assert [s.status.value for s in to_samples(dock.rollout_batch())[0]] == ["completed", "truncated"]
    dock = TransferDock.from_config(cfg, [EOS])
    dock.load_groups([0], [simulated_prompt(0, 4)], [0])
    ids = [[SAMPLE_KEY_BASE, FILL_TOKEN, FILL_TOKEN, EOS], [SAMPLE_KEY_BASE, FILL_TOKEN, FILL_TOKEN, 9]]
    answers = [answer("a", 4, ids[0], [[-1.0, t, None] for t in ids[0]], "length", EOS, 0, 0.0),
               answer("b", 4, ids[1], [[-1.0, t, None] for t in ids[1]], "stop", EOS, 0, 0.0)]  # a stop string
    tokens, logprobs, stopped, versions = parse_responses(answers, 0)
    assert stopped.tolist() == [False, True]
    dock.put_generation(dock.take_rows(), tokens, logprobs, versions, stopped)
    assert dock.stopped[:2].tolist() == [True, True] and dock.complete[:2].all()


def test_abort_from_a_callback_stops_the_clock_and_keeps_the_tokens_so_far():
    eng = engine({0: [3, 5], 1: [4]})
    answers = {}

    def on_result(i, resp):
        answers[i] = resp
        eng.abort_all()

    out = eng.generate([request(simulated_prompt(0, 4))] * 2 + [request(simulated_prompt(1, 4))], on_result=on_result)
    assert eng.clock_s == pytest.approx(0.0368)  # the moment request 0 ended
    assert sorted(answers) == [0, 1, 2] and out[1] is answers[1]
    assert out[1].output_ids == [SAMPLE_KEY_BASE + 1, FILL_TOKEN, FILL_TOKEN]  # 3 completed steps
    assert out[1].meta_info.finish_reason.type == "abort"
    assert out[2].output_ids == [] and out[2].meta_info.finish_reason.type == "abort"  # was queued
    # the cut row continues from its ids and keeps its natural length (5): 2 more tokens, the last EOS
    cont = eng.generate([request(simulated_prompt(0, 4) + out[1].output_ids)])
    assert cont[0].output_ids == [FILL_TOKEN, EOS] and cont[0].meta_info.finish_reason.type == "stop"
    # the request that never ran starts fresh as sample 0 of its group
    fresh = eng.generate([request(simulated_prompt(1, 4))])
    assert fresh[0].output_ids == [SAMPLE_KEY_BASE, FILL_TOKEN, FILL_TOKEN, EOS]


def test_abort_mid_step_counts_only_completed_steps_and_returns_unused_sample_keys():
    timing = EngineTiming(num_engines=2, slots_per_engine=1, step_base_s=0.010, step_per_seq_s=0.0,
                          prefill_per_token_s=0.001)
    eng = engine({0: [1], 1: [50]}, timing)
    # engine 0: prefill 3 ms + 10 ms -> request 0 ends at 13 ms; engine 1's request has a 30-token
    # prompt: its first step ends at 40 ms, so at 13 ms it has nothing and its sample key goes back
    out = eng.generate([request(simulated_prompt(0, 3)), request(simulated_prompt(1, 30))],
                       on_result=lambda i, r: eng.abort_all())
    assert eng.clock_s == pytest.approx(0.013)
    assert out[1].output_ids == [] and out[1].meta_info.finish_reason.type == "abort"
    again = eng.generate([request(simulated_prompt(1, 30), max_new=2)])
    assert again[0].output_ids == [SAMPLE_KEY_BASE + 0, FILL_TOKEN]  # still sample 0 of group 1


def test_weight_version_and_advance():
    eng = engine({0: [2, 2]})
    eng.update_weights(None, 7)
    eng.advance(1.5)
    out = eng.generate([request(simulated_prompt(0, 3))])
    assert out[0].meta_info.weight_version == 7
    assert eng.clock_s == pytest.approx(1.5 + 0.011 * 2 + 0.0003)
    assert eng.usage()["engine_busy_s"] == pytest.approx(0.022 + 0.0003)


def test_lognormal_lengths_are_seeded_per_group():
    lengths = LognormalLengths(n=16, median=2000, sigma=1.0, seed=3)
    assert np.array_equal(lengths.group_lengths(5), LognormalLengths(n=16, seed=3).group_lengths(5))
    assert not np.array_equal(lengths.group_lengths(5), lengths.group_lengths(6))
    many = np.concatenate([lengths.group_lengths(g) for g in range(200)])
    assert 1700 < np.median(many) < 2300 and many.min() >= 1


def run_iterations(mode: str, max_split: int, iterations: int = 4, extra: int = 0) -> tuple[float, float, int]:
    """A small long-tail workload through the real dock and driver loop -> (trained tokens per s, stale share,
    token_staleness_max over the run)."""
    cfg = RolloutConfig(global_batch_size=16, n_samples_per_prompt=4, max_tokens=2048, max_model_len=2048 + 16,
                        max_split=max_split, mode=mode, over_sampling_groups=extra)
    dock = TransferDock.from_config(cfg, [EOS])  # the staleness bound on, as in a run
    eng = SimulatedEngine(EngineTiming(num_engines=2, slots_per_engine=16), LognormalLengths(n=4, median=150, seed=1))
    next_id, tokens, stale, worst = 0, 0, 0, 0
    for it in range(iterations):
        count = groups_for_iteration(dock, 1000)
        dock.load_groups(np.arange(next_id, next_id + count), [simulated_prompt(g, 8) for g in range(next_id, next_id + count)],
                         [0] * count)
        next_id += count
        generate_rounds(dock, eng, cfg, SamplingSettings(stop_token_ids=[EOS]), weight_version=it)
        dock.select_batch()
        batch = dock.batch_arrays()
        assert not dock.in_flight.any() and len(batch["group_ids"]) == 16
        tokens += int(batch["response_lengths"].sum())
        stale += int((batch["weight_versions"] < it).sum())
        worst = max(worst, token_staleness_max(batch["weight_versions"], it))
        dock.clear()
        eng.update_weights(None, it + 1)
    return tokens / eng.clock_s, stale / tokens, worst


def test_partial_rollout_beats_no_partial_on_a_long_tail():
    base, base_stale, _ = run_iterations("sync", 1)
    sync4, _, _ = run_iterations("sync", 4)
    async_, async_stale, _ = run_iterations("async", 2)
    assert base_stale == 0 and async_stale > 0
    assert sync4 > 1.1 * base and async_ > 1.2 * base, (base, sync4, async_)


@pytest.mark.parametrize("mode,max_split,extra", [("sync", 3, 0), ("sync", 2, 8), ("async", 2, 0), ("async", 1, 8)])
def test_the_driver_loop_keeps_the_staleness_bound(mode, max_split, extra):
    cfg = RolloutConfig(max_split=max_split, mode=mode, over_sampling_groups=extra)
    _, stale_share, worst = run_iterations(mode, max_split, iterations=5, extra=extra)
    assert 0 < worst <= cfg.effective_max_age - 1 and stale_share > 0


def test_longtail_bench_prints_one_json_line_per_mode(capsys):
    import json

    from spillover.bench.longtail import TODAY_MODES, main

    import logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        main(["--gbs", "8", "--n", "4", "--max-tokens", "512", "--median", "40", "--engines", "2", "--slots", "8",
              "--prompt-tokens", "8", "--token-scale", "1", "--iterations", "1", "--warmup", "1", "--update-s", "1"])
    finally:  # the bench points the root logger at this test's captured stderr, closed after the test
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["mode"] for line in lines] == list(TODAY_MODES)
    for line in lines:
        assert {"tokens_per_s", "iteration_s", "engine_idle_share", "stale_token_share", "speedup"} <= set(line)
        assert line["tokens_per_s"] > 0 and 0 <= line["engine_idle_share"] <= 1
    assert lines[0]["speedup"] == 1.0 and lines[0]["stale_token_share"] == 0


def test_longtail_bench_refuses_overlap_modes_on_real_engines(capsys):
    from spillover.bench.longtail import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--real", "--modes", "no_partial,overlap_in_place"])
    assert "['overlap_in_place'] run in the simulator only (drop --real)" in capsys.readouterr().err
    assert parse_args(["--modes", "no_partial,overlap_in_place"]).modes == ["no_partial", "overlap_in_place"]
