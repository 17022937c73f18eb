"""Kill -9 in async mode, then resume: `spillover train` with rollout.mode=async SIGKILLs itself at the start of
iteration 1's update (kill point "update:1"): iteration 1's rollout already aborted its engines once GBS groups were
ready, so the dock in memory holds rows cut mid-response that no checkpoint has. `resume` (in process, on the session's
warm parts) goes on from checkpoint 0, whose dock holds iteration 0's cut rows. With rollout.overlap the kill falls
while the requests left running past iteration 1's batch choice may still generate: their tokens never reached a
checkpoint and are generated again.

Async mode is not compared with an uninterrupted run: which groups are ready first depends on timing, so two
runs train different batches. What must hold is what async promises: every loaded prompt group trained exactly once
over the run, the rows checkpoint 0 carried cut trained from exactly their stored tokens, and no trained token more
than max_age - 1 versions old. The killed runs start with the session as background work (tests/fixtures_early.py) and
join the background Ray cluster: their processes and actors must be gone.

Stop strings end responses at seeded positions: without them almost every row of the random tiny model runs to
max_tokens, rows finish in lockstep waves of max_running_requests, and the batch is ready exactly when a wave ends,
so the abort could find only rows that had not made a token yet (nothing cut mid-response). Without overlap the rows
may run to 128 tokens (one stop string), not the small runs' 16, for the same reason: the killed run is niced, and its
driver, starved for a while after the batch is ready, can find every row it had sent already finished. The seeded
stop positions fix when the batch is ready (checkpoint 0's cut rows held 20-53 tokens in every run measured) while the
longest rows in flight then run on to ~100 tokens: a miss needs a stall of ~50 decode steps between the answer that
makes the batch and the abort, in which the driver does nothing else (the progress report waits for the abort). With overlap they stay short: under max_age 2 the rows carried into an
iteration must finish in it, long ones finish last, and by then every other row is done too, so nothing would be left
running past the batch choice."""
from __future__ import annotations

import signal

import pytest
from partial_evidence import assert_cut_rows_trained, assert_partial_rollout_happened, cut_rows, trained_samples
from small_run import SMALL_RUN
from spillover_runs import ROUTER, assert_joined_runs_left_nothing, metrics_rows

ITERATIONS, GBS, N = 3, 16, 4
ROWS = {False: (128, '["x"]'), True: (16, '["x","q","z"]')}  # overlap -> (rollout.max_tokens, rollout.stop): why above


def async_args(run_dir, overlap: bool) -> list[str]:
    args = ["train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", f"schedule.num_iterations={ITERATIONS}",
            *SMALL_RUN, "rollout.mode=async", f"rollout.overlap={str(overlap).lower()}", f"rollout.global_batch_size={GBS}", f"rollout.n_samples_per_prompt={N}",
            "grpo.micro_batch_size=32", "engines.rollout_num_gpus=1", "tracking.wandb_mode=disabled",
            "tracking.progress=false", "rollout.deterministic_sampling=true",
            f"storage.save_debug_rollout_data={run_dir}/debug/rollout_{{rollout_id}}.parquet"]
    max_tokens, stop = ROWS[overlap]
    return [*args, f"rollout.max_tokens={max_tokens}", f"rollout.max_model_len={max_tokens + 16}", f"rollout.stop={stop}"]


@pytest.mark.early("async_killed_runs", cpu_s=20)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("overlap", [False, True], ids=["async", "overlap"])
def test_kill_9_at_an_async_update_then_resume_trains_every_group_once(async_killed_runs, background, warm_parts,
                                                                       overlap):
    from spillover.infra.config.run_config import load_run_config
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.storage.store import open_store

    spillover, killed, run_dir = async_killed_runs[overlap].result()
    assert killed.returncode == -signal.SIGKILL, spillover.output(killed)
    assert killed.saw(ROUTER)
    store = open_store(str(run_dir / "checkpoints"))
    assert load_latest_checkpoint(store).iteration == 0
    # iteration 0's abort cut rows mid-response (and some before their first token); checkpoint 0 carries them.
    # With overlap nothing is cut: the rows still generating went on, and checkpoint 0 holds them as sent
    cut = [row for row in cut_rows(store, 0) if row.tokens]
    assert (not cut if overlap else cut and all(len(row.tokens) < ROWS[False][0] for row in cut)), cut

    cfg = load_run_config(run_dir, ["engines.rollout_num_gpus=2"])  # the warm parts of the suite's small runs
    grpo_train(cfg, resume=True, parts=warm_parts)
    spillover.check_gone(killed)
    assert_joined_runs_left_nothing(lambda: background.actors_of([killed.session]))

    rows = metrics_rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    assert rows[0]["rounds"] == 1, rows[0]  # async: one round, stopped once ready (sync takes several)
    trained = [g for r in rows for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(ITERATIONS * GBS)), trained  # each group once, none lost to the kill
    if overlap:  # rows are not cut but keep generating: tokens past a batch choice arrive, within the bound
        assert sum(r["detached_tokens"] for r in rows[1:]) > 0, [r["detached_tokens"] for r in rows]
        assert max(r["token_staleness_max"] for r in rows) <= cfg.rollout.effective_max_age - 1
        return
    assert_partial_rollout_happened(rows, cfg.rollout.effective_max_age)
    # async max_age 2: a group started in iteration 0 is trained in iteration 1 at the latest, cut rows included
    assert_cut_rows_trained(cut, trained_samples(str(run_dir / "debug" / "rollout_{rollout_id}.parquet"), 1),
                            trained_version=1)
