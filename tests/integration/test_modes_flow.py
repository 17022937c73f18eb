"""Every rollout and training mode through the training flow (in-process `grpo_train` on warm parts, a small config):
each test asserts what its mode does, so that it fails when the mode is silently ignored. Scheduling modes and the
external router: tests/integration/test_modes_dispatch_flow.py."""
import json

import numpy as np
import pytest

from test_train_flow import small_config

FLOW = ["prefect_harness", "ray_session"]
ROLLOUT_ONLY_TASKS = {"load_prompts", "generate_until_ready", "compute_reward", "clear_and_age_sort", "save_checkpoint"}


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Rows of varied, seeded lengths for the async test, so that the abort finds rows mid-response. Without a stop
# string almost every row of the random tiny model runs to max_tokens, rows finish in lockstep waves of the engines'
# slots, and the batch is ready exactly when a wave ends: the abort then finds only rows without a token. With one
# stop string at seeded positions the batch is ready at a fixed point of the seeded lengths (checkpoint 0's cut rows
# held 20-53 tokens in every run measured) while the longest rows in flight run on to ~100 tokens: the abort misses
# them all only if the driver stalls for ~50 decode steps between the answer that makes the batch and the abort
# (nothing runs in between: the progress report waits until the engines are aborted, rollout/drivers/rounds.py).
ASYNC_ROWS = {"rollout.max_tokens": 128, "rollout.max_model_len": 144, "rollout.stop": '["x"]',
              "rollout.deterministic_sampling": "true"}


@pytest.mark.usefixtures(*FLOW)
def test_async_mode_aborts_and_trains_the_cut_tokens_in_a_later_iteration(tmp_path, warm_parts):
    """rollout.mode=async: every open row goes out at once with its whole budget (one round, 2 x GBS x n requests;
    sync would need rounds of max_tokens // max_split tokens and at most GBS x n rows each), the engines abort once
    GBS groups are ready (128 rows for 64 slots: rows still decoding are cut), and the cut rows' tokens are trained
    after an update: checkpoint 0 holds rows cut mid-response, and iteration 1 trains each of them continued from
    exactly those tokens, one weight version older than the rest."""
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.store import open_store
    from partial_evidence import assert_cut_rows_trained, cut_rows, trained_samples

    gbs, n, run_dir = 16, 4, tmp_path / "run"
    debug = f"{run_dir}/debug/{{rollout_id}}.parquet"
    grpo_train(small_config(run_dir, iterations=3, **ASYNC_ROWS, **{
        "rollout.mode": "async", "rollout.global_batch_size": gbs, "grpo.micro_batch_size": 32,
        "storage.keep_checkpoints": 3, "storage.save_debug_rollout_data": debug}), parts=warm_parts)
    got = rows(run_dir)
    assert (got[0]["rounds"], got[0]["requests"]) == (1, 2 * gbs * n), got[0]
    cut = [row for row in cut_rows(open_store(str(run_dir / "checkpoints")), 0) if row.tokens]
    assert cut and got[0]["partial_rows"] == len(cut), (got[0]["partial_rows"], cut)  # rows with tokens only
    assert_cut_rows_trained(cut, trained_samples(debug, 1), trained_version=1)
    assert max(r["version_span_max"] for r in got[1:]) >= 1, [r["version_span_max"] for r in got]
    assert max(r["token_staleness_max"] for r in got) == 1  # async max_age 2: cut tokens trained one update late
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(3 * gbs))


# Rows that cannot end early (rollout.ignore_eos: no EOS ends one, so every row runs exactly max_tokens steps) on
# engines of one decode slot each: rows run in waves of two, one per engine. GBS 2 x 2 samples are ready after two
# waves; max_age 3 with two over-sampled groups starts six groups at once, so four waves (~4 x 1 s of decoding at
# 1,024 tokens a row) are still to run when the batch is ready, while reward, logprobs and the update of 4 rows take
# ~0.6 s: the update of iteration 0 always finds requests generating (a stall of several seconds would be needed to
# miss it). Measured: update_while_generating [1, 1, 0], the learner's update ~0.37 s.
OVERLAP_ROWS = {"rollout.ignore_eos": "true", "rollout.max_tokens": 1024, "rollout.max_model_len": 1040,
                "engines.max_running_requests": 1, "rollout.global_batch_size": 2, "rollout.n_samples_per_prompt": 2,
                "rollout.max_age": 3, "rollout.over_sampling_groups": 2, "grpo.micro_batch_size": 4}


@pytest.mark.usefixtures(*FLOW)
@pytest.mark.parametrize("adopt", [False, True])
def test_overlap_generates_through_the_update_and_keeps_the_bound(tmp_path, warm_parts, adopt):
    """rollout.overlap=true (async): the requests running when the dock is ready are not aborted; they generate on
    through reward, logprobs and the update (paused and continued: retract keeps every token), and their tokens reach
    the dock at the next generate step, where rows made by two weight versions are trained (ignored: no detached
    token would arrive, and no update would find requests running). adopt (rollout.adopt_detached): the requests
    still running at the next step are taken over by it instead of being cut and sent again (a 1024-token request
    outlives the ~0.4 s update on these engines). The fleet-level view of one request living through an update:
    tests/integration/test_overlap_manager.py."""
    from spillover.flows.train import grpo_train

    gbs = 2
    grpo_train(small_config(tmp_path / "run", iterations=3, **{"rollout.mode": "async", "rollout.overlap": True,
                                                              "rollout.adopt_detached": adopt},
                            **OVERLAP_ROWS), parts=warm_parts)
    got = rows(tmp_path / "run")
    assert got[0]["requests"] == 12 and got[0]["ready_groups"] == gbs, got[0]  # six groups started, two ready
    assert got[0]["update_while_generating"] == 1, [r["update_while_generating"] for r in got]
    adopted = [r["adopted_requests"] for r in got]
    if adopt:  # taken over, never sent twice: the requests of later steps are only the rows not running then
        assert adopted[0] == 0 and sum(adopted[1:]) > 0, adopted
    else:
        assert adopted == [0, 0, 0] and sum(r["detached_tokens"] for r in got[1:]) > 0, [r["detached_tokens"]
                                                                                         for r in got]
    assert max(r["version_span_max"] for r in got[1:]) >= 1, [r["version_span_max"] for r in got]
    assert [r["tokens_cut_by_updates"] for r in got] == [0, 0, 0]  # retract: requests live through an update
    shares = [r["overlap_generating_share"] for r in got]  # iteration 0 collects nothing; later, detached tokens came
    assert shares[0] == 0 and all(0 < s <= 1 for s, r in zip(shares[1:], got[1:]) if r["detached_tokens"]), shares
    assert max(r["token_staleness_max"] for r in got) <= 2  # max_age 3: the bound holds through overlap
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(3 * gbs))


@pytest.mark.usefixtures(*FLOW)
def test_over_sampled_surplus_groups_are_generated_and_trained_the_next_iteration(tmp_path, warm_parts):
    """rollout.over_sampling_groups=2 without partial rollout (max_split 1): iteration 0 loads and generates GBS + 2
    groups in one round, trains GBS of them, and the two surplus groups (complete, made by weight version 0) are
    trained first in iteration 1, one update late. Ignored, iteration 1 would train four fresh groups."""
    from spillover.flows.train import grpo_train

    grpo_train(small_config(tmp_path / "run", iterations=3, **{"rollout.over_sampling_groups": 2,
                                                              "rollout.max_split": 1}), parts=warm_parts)
    got = rows(tmp_path / "run")
    assert got[0]["loaded_groups"] == 6 and got[0]["requests"] == 6 * 4 and got[0]["rounds"] == 1
    assert sorted(got[0]["trained_stream_ids"]) == [0, 1, 2, 3]
    assert sorted(got[1]["trained_stream_ids"]) == [4, 5, 6, 7]  # 4 and 5: iteration 0's surplus
    assert [r["token_staleness_max"] for r in got] == [0, 1, 1]  # the surplus' tokens are one version old
    assert all(r["partial_rows"] == 0 for r in got)  # whole responses: only over-sampling carries groups over
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(12))


@pytest.mark.usefixtures(*FLOW)
def test_adaptive_kl_moves_the_coefficient_by_the_measured_kl(tmp_path, warm_parts):
    """grpo.kl_ctrl=adaptive: the coefficient each update uses follows tasks/kl_control.next_kl_coef from the KL the
    previous update measured: down after the first update (policy = reference, KL 0), up once the trained policy's
    KL exceeds the target (fixed would keep 0.05 throughout)."""
    from spillover.flows.train import grpo_train
    from spillover.tasks.learner.kl_control import next_kl_coef

    target, horizon, samples = 1e-6, 32, 16
    grpo_train(small_config(tmp_path / "run", iterations=3, **{
        "grpo.kl_coef": 0.05, "grpo.kl_ctrl": "adaptive", "grpo.kl_target": target, "grpo.kl_horizon": horizon,
        "optimizer.lr": 0.01, "grpo.reward_function_path": "small_run.distinct_chars"}),  # rewards vary: weights move
               parts=warm_parts)
    got = rows(tmp_path / "run")
    coefs = [r["kl_coef"] for r in got]
    assert got[0]["kl"] == 0 and got[1]["kl"] > target, [r["kl"] for r in got]
    assert coefs[0] == 0.05 and coefs[1] < coefs[0] and coefs[2] > coefs[1], coefs
    for before, after in zip(got, got[1:]):
        assert after["kl_coef"] == pytest.approx(next_kl_coef(before["kl_coef"], before["kl"], samples, "adaptive",
                                                              target, horizon), rel=1e-6)


@pytest.mark.usefixtures(*FLOW)
def test_rollout_only_starts_no_learner_and_runs_no_logprob_or_update(tmp_path, warm_parts):
    """schedule.debug_rollout_only: engines generate and rewards are scored; no learner group is started or borrowed,
    no logprob or update task runs, the engines keep weight version 0, and no checkpoint is written (no learner
    state to keep)."""
    from spillover.flows.train import grpo_train

    parts_before = warm_parts.started + warm_parts.reused
    grpo_train(small_config(tmp_path / "run", iterations=2, **{"schedule.debug_rollout_only": "true"}),
               parts=warm_parts)
    got = rows(tmp_path / "run")
    assert warm_parts.started + warm_parts.reused - parts_before == 1  # the engines only
    assert [set(r["task_s"]) for r in got] == [ROLLOUT_ONLY_TASKS] * 2
    assert all("loss" not in r and "weight_version" not in r and "reward_mean" in r for r in got)
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(8))
    assert not any((tmp_path / "run" / "checkpoints").glob("*"))


def scored_rollout(args, rollout_id, data_source, evaluation=False):
    """A custom (non-SFT) rollout function: GBS groups of n engine samples, each scored by the function itself with
    0.1 x its index in the group (slime: the function sets Sample.reward)."""
    from spillover.rollout.drivers.requests import build_requests, parse_responses, SamplingSettings
    from spillover.rollout.sample import Sample, Status
    from spillover.rollout.sglang.protocol import GenerateJob

    gbs, n = args.rollout.global_batch_size, args.rollout.n_samples_per_prompt
    prompts = data_source.prompts
    groups = []
    for g in range(rollout_id * gbs, (rollout_id + 1) * gbs):
        ids = list(prompts.tokens[g % len(prompts.tokens)])
        samples = [Sample(g, g * n + i, ids, label=prompts.labels[g % len(prompts.labels)]) for i in range(n)]
        sampling = SamplingSettings(args.rollout.temperature, stop_token_ids=data_source.stop_token_ids)
        requests = build_requests([ids] * n, np.full(n, args.rollout.max_tokens), sampling)
        answers = data_source.fleet.generate([GenerateJob(request) for request in requests])
        tokens, logprobs, stopped, _ = parse_responses(answers, data_source.weight_version)
        for i, s in enumerate(samples):
            s.append_segment(tokens[i], logprobs[i], data_source.weight_version)
            s.status = Status.COMPLETED if stopped[i] else Status.TRUNCATED
            s.reward = 0.1 * i
        groups.append(samples)
    return groups


def half(response, label, **_):
    return 0.5


@pytest.mark.usefixtures(*FLOW)
def test_a_custom_rollout_functions_own_rewards_are_trained_unless_a_reward_function_is_set(tmp_path, warm_parts):
    """rollout.rollout_function_path=a function that scores its samples: those rewards are trained (group-normalised:
    0, 0.1, 0.2, 0.3 in every group), as in slime; with grpo.reward_function_path set, that function scores them."""
    from spillover.flows.train import grpo_train

    custom = {"rollout.rollout_function_path": "test_modes_flow.scored_rollout"}
    grpo_train(small_config(tmp_path / "own", iterations=2, **custom), parts=warm_parts)
    own = rows(tmp_path / "own")
    assert [r["trained_stream_ids"] for r in own] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the function's groups
    for r in own:
        assert r["reward_mean"] == pytest.approx(0.15) and r["reward_std"] == pytest.approx(np.std([0, .1, .2, .3]))
        assert r["grad_norm"] > 0  # the advantages of those rewards moved the weights
    grpo_train(small_config(tmp_path / "set", iterations=1, **custom,
                            **{"grpo.reward_function_path": "test_modes_flow.half"}), parts=warm_parts)
    assert [(r["reward_mean"], r["reward_std"]) for r in rows(tmp_path / "set")] == [(0.5, 0.0)]


def weight_version_eval(args, rollout_id, data_source, evaluation=False):
    """A custom eval function with data of its own (no data.eval_paths): one greedy engine sample per prompt of the
    first two training prompts, each scored with the weight version the engines serve."""
    from spillover.rollout.drivers.requests import SamplingSettings, build_requests, parse_responses
    from spillover.rollout.sample import Sample
    from spillover.rollout.sglang.protocol import GenerateJob

    assert evaluation
    samples = []
    for g in range(2):
        ids = list(data_source.prompts.tokens[g])
        request = build_requests([ids], np.array([4]), SamplingSettings(temperature=0.0))[0]
        answer = data_source.fleet.generate([GenerateJob(request)])
        tokens, logprobs, _, versions = parse_responses(answer, -1)
        sample = Sample(g, g, ids)
        sample.append_segment(tokens[0], logprobs[0], int(versions[0]))
        sample.reward = float(data_source.weight_version)
        samples.append([sample])
    return {"versions": samples}


@pytest.mark.usefixtures(*FLOW)
def test_a_custom_eval_function_runs_at_the_eval_interval_and_its_scores_are_logged(tmp_path, warm_parts):
    """rollout.eval_function_path with schedule.eval_interval=1: the function runs after every update (it sees the
    new weight version) and eval/<its key> is what it scored. (Before this test it never ran without
    data.eval_paths.)"""
    from spillover.flows.train import grpo_train

    grpo_train(small_config(tmp_path / "run", iterations=2, **{"rollout.eval_function_path": "test_modes_flow."
                                                                "weight_version_eval", "schedule.eval_interval": 1}),
               parts=warm_parts)
    got = rows(tmp_path / "run")
    assert [(r["eval/versions"], r["eval/step"]) for r in got] == [(1.0, 0), (2.0, 1)]


@pytest.mark.usefixtures(*FLOW)
def test_reward_model_scores_are_the_trained_reward(tmp_path, warm_parts):
    """grpo.reward_models with the rule reward weighed 0: the trained reward is 2 x the classifier's score
    (reward_model_rm_mean), and it varies within groups (the rule reward alone would be 0 everywhere)."""
    from spillover.flows.train import grpo_train
    from test_reward_models import build_classifier

    classifier = build_classifier(tmp_path / "rm")
    models = json.dumps([{"path": classifier, "weight": 2.0, "name": "rm"}])
    grpo_train(small_config(tmp_path / "run", iterations=2, **{"grpo.reward_models": models,
                                                              "grpo.rule_reward_weight": 0.0}), parts=warm_parts)
    for r in rows(tmp_path / "run"):
        assert r["reward_mean"] == pytest.approx(2.0 * r["reward_model_rm_mean"], abs=1e-6)
        assert r["reward_std"] > 0 and r["grad_norm"] > 0
