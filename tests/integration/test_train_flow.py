"""The training flow end to end on CPU: real Ray actors, real torch engines behind the real sglang
router, Prefect's test harness. A few small iterations with partial rollout on, shown to happen: rows are cut,
carried over in checkpoint 0's dock and trained stale by the next iteration, and by a run resumed from that
checkpoint (seeded sampling makes the cuts the same in every run: tests/integration/test_seeded_sampling.py)."""
import json
import shutil

from spillover.infra.config.run_config import load_config
from partial_evidence import assert_cut_rows_trained, assert_partial_rollout_happened, cut_rows, trained_samples
from small_run import SMALL_RUN
from waiting import wait_for

# The seven steps of the algorithm, and the checkpoint as a task of its own.
ITERATION_TASKS = ["clear_and_age_sort", "compute_old_logprob", "compute_ref_logprob", "compute_reward",
                   "generate_until_ready", "load_prompts", "save_checkpoint", "update"]


def small_config(run_dir, iterations=3, **extra):
    overrides = [f"run_dir={run_dir}", f"schedule.num_iterations={iterations}", *SMALL_RUN,
                 "tracking.wandb_mode=disabled"]
    return load_config("configs/tiny.yaml", overrides + [f"{k}={v}" for k, v in extra.items()])


def task_names_by_iteration(parent_id, flow_names):
    """{subflow name: (state, sorted task names)} of the named subflows of one flow run (the session's Prefect
    server holds other tests' runs with the same subflow names)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterParentFlowRunId, \
        TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=flow_names), parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
        out = {}
        for run in runs:
            tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
            out[run.name] = (run.state.type.value, sorted(t.name.rsplit("-", 1)[0] for t in tasks))
        return out


# Seeded sampling: the same rows are cut in every run. Checkpoint 0 is kept (2 by default) and each rollout's
# samples are written (debug rollout data): the test follows checkpoint 0's cut rows into what iteration 1 trains.
PARTIAL_EVIDENCE = {"rollout.deterministic_sampling": "true", "storage.keep_checkpoints": 3}


def debug_template(run_dir) -> str:
    return f"{run_dir}/debug/{{rollout_id}}.parquet"


def resume_from_checkpoint_0(run_dir, resumed_dir, parts):
    """A run resumed from `run_dir`'s checkpoint 0 (as after a crash in iteration 1), in `resumed_dir`, on `parts`."""
    from spillover.infra.config.run_config import load_run_config
    from spillover.flows.train import grpo_train

    resumed_dir.mkdir()
    shutil.copy(run_dir / "config.json", resumed_dir / "config.json")
    shutil.copytree(run_dir / "checkpoints" / "ckpt-00000000", resumed_dir / "checkpoints" / "ckpt-00000000")
    grpo_train(load_run_config(resumed_dir, [f"storage.save_debug_rollout_data={debug_template(resumed_dir)}"]),
               resume=True, parts=parts)


def test_flow_runs_seven_tasks_per_iteration_and_trains_each_group_once(prefect_harness, ray_session, warm_parts, tmp_path):
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.store import open_store

    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, **PARTIAL_EVIDENCE, **{"storage.save_debug_rollout_data": debug_template(run_dir)})
    state = grpo_train(cfg, return_state=True, parts=warm_parts)
    summary = state.result()
    assert summary["iterations"] == 3

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "response_length_p50", "response_length_max", "partial_rows", "time_s",
                "trained_group_ids", "loss", "kl", "clip_fraction", "tis_weight_mean", "task_s",
                "token_staleness_max", "version_span_max", "is_weight_p99", "masked_token_share",
                "logprob_mismatch_kl"):
        assert key in rows[0], key
    max_age = cfg.rollout.effective_max_age  # the staleness bound is on by default
    assert all(0 <= r["token_staleness_max"] <= max_age - 1 for r in rows), [r["token_staleness_max"] for r in rows]
    assert_partial_rollout_happened(rows, max_age)  # rows were cut, and trained max_age - 1 versions stale
    trained = [g for r in rows for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(3 * 4))  # every loaded group trained exactly once, none twice
    assert all(len(r["trained_group_ids"]) == 4 for r in rows)
    assert rows[-1]["partial_rows"] == 0  # the last iteration drains
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["prompt_independent_baseline"] > 0
    assert not (tmp_path / "run" / "report").exists()  # tracking.report=false (SMALL_RUN): no plots

    cut = cut_rows(open_store(str(run_dir / "checkpoints")), 0)  # what checkpoint 0's dock carries over unfinished
    assert cut and all(0 < len(row.tokens) < cfg.rollout.max_tokens for row in cut), cut
    assert {row.group_id for row in cut} <= set(rows[1]["trained_stream_ids"])
    assert_cut_rows_trained(cut, trained_samples(debug_template(run_dir), 1), trained_version=1)
    resumed_dir = tmp_path / "resumed"
    resume_from_checkpoint_0(run_dir, resumed_dir, warm_parts)
    assert_cut_rows_trained(cut, trained_samples(debug_template(resumed_dir), 1), trained_version=1)
    resumed_rows = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["trained_stream_ids"] for r in resumed_rows] == [r["trained_stream_ids"] for r in rows]

    names = [f"iteration-{i:04d}" for i in range(3)]
    # the server records task runs in batches (see infra/prefect/env.py)
    found = wait_for(lambda: task_names_by_iteration(state.state_details.flow_run_id, names), 20,
                     "every iteration's task runs recorded", every=1,
                     until=lambda now: all(now.get(n, ("", []))[1] == ITERATION_TASKS for n in names))
    for name in names:
        state, tasks = found[name]
        assert state == "COMPLETED" and tasks == ITERATION_TASKS, (name, found[name])
