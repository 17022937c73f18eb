"""Kill -9 and resume, end to end: `spillover train` / `spillover resume` as subprocesses that SIGKILL
themselves at a chosen point of iteration 1 (SPILLOVER_KILL_AT through the kill_hook test plugin), and the
end is the uninterrupted run's: every prompt group trained exactly once and the final checkpoint's policy
tensors (weights, AdamW state, torch RNG) bit-identical.

Chains cover the whole matrix. Each task kill point (the start of each of the iteration's tasks) leaves
the same durable state, checkpoint 0, so a chain is: `train` killed at one task start of iteration 1, then
`resume` killed at the next one, and so on, then a `resume` that finishes. Each resume starts from what the
previous kill left, so a kill that damaged durable state shows in the final comparison, and the state is
checked after every kill too. One process start per kill point instead of two. The kill points are split
between two chains (tests/e2e/kill_chains.py) that run side by side as background work (tests/background.py: they
start with the session, at the lowest CPU priority, while the other tests run); this test runs last, runs the
uninterrupted reference (in the test's process, on the session's warm parts) and compares:
- on the real S3 server, ending with a kill in iteration 1's checkpoint write after every object and before
  the manifest (a half-written checkpoint that must never be loaded). Keys go as config values to `train`
  and from the environment to every `resume` (config.json never holds them), and at the end neither key
  appears in the run directory, the processes' output, the checkpoint objects or the chain's rows of the session's
  Prefect database (its flow runs' parameters, states, logs, artifacts, events);
- on local files, with the engine colocated in the learner's process (placement.colocate): the kills then also
  fall between its release and its resume, and the run must still end as the reference run, whose engines are
  their own actors.
The first run of the S3 chain and the last run of the file chain start their own local Ray, as `spillover` does by
default: a killed driver's local Ray (GCS, raylet, agents, workers) must go with it, and a finished run's too (one
Ray start per chain keeps the chains equally long). The other runs join the background Ray cluster (RAY_ADDRESS, as
on a real cluster), which saves a Ray start per run: Ray must end each killed driver's job, so every actor those runs
created is dead and its worker process gone soon after the chains end (read from the GCS, by the drivers' pids). How a
local Ray dies does not depend on where its driver was killed; the durable state is checked at every kill point either
way.

Determinism needs three settings (kill_chains.DETERMINISTIC): rollout.deterministic_sampling (every request
carries a sampling_seed, so tokens do not depend on batching, timing or the engine; tested in
tests/integration/test_seeded_sampling.py), and old logprobs from the learner without truncated IS
(grpo.skip_old_logprob=false, grpo.off_policy=none): the CPU engine's logprobs are equal only up to ~1e-7
across batch compositions, which would reach the weights through the loss.

Partial rollout is shown to happen, not only to be harmless: the reference run carries cut rows over and reaches the
staleness bound (token_staleness_max == max_age - 1; seeded sampling cuts the same rows every time), each chain reads
checkpoint 0's dock after its first kill (cut rows: generated, 0 < length < max_tokens, not complete), and its
finishing resume, which starts from checkpoint 0, trains those rows from exactly the stored tokens (its debug
rollout data, storage.save_debug_rollout_data), as the reference run's iteration 1 does.

No run may leave a process behind (tests/spillover_runs.py checks each run's session and, for runs that joined
the background cluster, their actors). The test requires the router to have been seen in every run and the ephemeral
Prefect server in the one run that uses it (the S3 chain's second link; the others share the session's Prefect
server). Leftovers of a link are checked while the next link already runs.
"""
from __future__ import annotations

import re
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import torch
from kill_chains import DETERMINISTIC, SMALL, debug_template
from partial_evidence import assert_cut_rows_trained, assert_partial_rollout_happened, trained_samples
from spillover_runs import assert_joined_runs_left_nothing, metrics_rows


def final_state(url: str, storage_cfg=None):
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.storage.store import open_store

    return load_latest_checkpoint(open_store(url, storage_cfg))


def assert_same_as_reference(run_dir: Path, state, ref_dir: Path, ref_state) -> None:
    rows, ref_rows = metrics_rows(run_dir), metrics_rows(ref_dir)
    assert [r["iteration"] for r in ref_rows] == [0, 1, 2] and ref_state.iteration == 2
    assert len({r["loss"] for r in ref_rows}) > 1 and ref_rows[0]["grad_norm"] > 0  # the weights really move
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    trained = [g for r in rows for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(12)), trained  # every group exactly once over the whole run
    for key in ("trained_stream_ids", "trained_group_ids", "reward_mean", "response_length_p50", "weight_version",
                "partial_rows", "token_staleness_max"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    assert state.iteration == ref_state.iteration == 2
    got, want = state.tensors["policy"], ref_state.tensors["policy"]
    assert sorted(got) == sorted(want)
    differing = [name for name in want if not torch.equal(got[name], want[name])]
    assert differing == [], f"{len(differing)} tensors differ from the uninterrupted run, e.g. {differing[:3]}"
    assert state.meta["cursor"] == ref_state.meta["cursor"]


def run_reference(ref_dir: Path, parts):
    """The uninterrupted run, in this process on the session's warm parts (tests/fixtures_warm.py: a run on
    kept parts trains bit for bit like one on new parts) instead of one more `spillover train` process. -> its
    rollout config."""
    from spillover.flows.train import grpo_train
    from spillover.infra.config.run_config import load_config

    # two engines (the shape the suite's warm parts have) where the chains have one: seeded sampling makes the
    # tokens independent of the engine count, so the comparison also checks that
    cfg = load_config("configs/tiny.yaml", [f"run_dir={ref_dir}", *SMALL, *DETERMINISTIC, "engines.rollout_num_gpus=2",
                                            f"storage.save_debug_rollout_data={debug_template(ref_dir)}"])
    grpo_train(cfg, parts=parts)
    return cfg.rollout


def assert_partial_rollout_shown(chain_evidence, ref_dir: Path, rollout) -> None:
    """Rows were cut and trained stale: the reference run reached the staleness bound, checkpoint 0's dock (read
    in the chain after its first kill) holds cut rows, and the chain's finishing resume from checkpoint 0 trained
    them from exactly those tokens, as the uninterrupted run did."""
    assert_partial_rollout_happened(metrics_rows(ref_dir), rollout.effective_max_age)
    assert chain_evidence.cut and all(0 < len(row.tokens) < rollout.max_tokens for row in chain_evidence.cut), \
        chain_evidence.cut
    assert_cut_rows_trained(chain_evidence.cut, chain_evidence.resumed_trained, trained_version=1)
    assert_cut_rows_trained(chain_evidence.cut, trained_samples(debug_template(ref_dir), 1), trained_version=1)


@pytest.mark.slow
@pytest.mark.early("kill_chain_runs", cpu_s=150)
@pytest.mark.timeout(1500)
def test_kill_9_at_every_point_then_resume_matches_uninterrupted_and_leaks_nothing(
        kill_chain_runs, background, s3_server, prefect_harness, warm_parts, tmp_path):
    """The chains ran (or still run) in the background; the reference runs now, in this process."""
    chains, ref_dir = kill_chain_runs, tmp_path / "reference"
    rollout = run_reference(ref_dir, warm_parts)
    s3_evidence, file_evidence = chains.s3_chain.result(), chains.file_chain.result()
    assert_joined_runs_left_nothing(lambda: background.actors_of([run.session for run in chains.runs]))
    ref_state = final_state(str(ref_dir / "checkpoints"))
    assert_same_as_reference(chains.s3_dir, final_state(chains.url, s3_server.storage_config()), ref_dir, ref_state)
    assert_same_as_reference(chains.file_dir, final_state(str(chains.file_dir / "checkpoints")), ref_dir, ref_state)
    assert_partial_rollout_shown(s3_evidence, ref_dir, rollout)
    assert_partial_rollout_shown(file_evidence, ref_dir, rollout)
    assert_no_credentials(chains.s3_dir, chains.runs, chains.url, s3_server, prefect_harness.database)


def assert_no_credentials(run_dir: Path, runs: list, url: str, s3_server, db: Path | None) -> None:
    from spillover.infra.storage.store import open_store

    store = open_store(url, s3_server.storage_config())
    texts = {str(p): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    texts.update({str(run.log): run.log.read_bytes() for run in runs})
    texts.update({f"{url}/ckpt-{i:08d}/{name}": store.get_bytes(f"ckpt-{i:08d}/{name}")
                  for i in (1, 2) for name in ("meta.json", "manifest.json")})
    assert db is not None and db.is_file()
    prefect_rows = rows_of_runs(db, run_dir)  # the database is the session's: every test's runs are in it
    assert any(url.encode() in data for data in prefect_rows.values())  # the flow's config is there
    texts.update(prefect_rows)
    assert str(run_dir / "config.json") in texts
    for secret in (s3_server.secret_key, s3_server.access_key):
        leaked = [name for name, data in texts.items() if secret.encode() in data]
        assert leaked == [], f"a storage credential is in {leaked}"


UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def rows_of_runs(db: Path, run_dir: Path) -> dict[str, bytes]:
    """Every row of a Prefect SQLite database that names a flow run of run_dir (a flow run whose parameters hold
    run_dir, and its subflows, found through their parent task runs) or one of their task runs: parameters,
    states, logs, artifacts, events. -> {"table:rowid": the row's values}."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        def ids(query: str, among: set[str]) -> set[str]:
            marks = ",".join("?" * len(among))
            return {row[0] for row in con.execute(query.format(marks), sorted(among))} if among else set()

        flows = {row[0] for row in con.execute("SELECT id FROM flow_run WHERE instr(parameters, ?) > 0",
                                               (str(run_dir),))}
        tasks, new_flows = set(), set(flows)
        while new_flows:
            new_tasks = ids("SELECT id FROM task_run WHERE flow_run_id IN ({})", new_flows)
            tasks |= new_tasks
            new_flows = ids("SELECT id FROM flow_run WHERE parent_task_run_id IN ({})", new_tasks) - flows
            flows |= new_flows
        ours = {i.encode() for i in flows | tasks}
        out = {}
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for n, row in enumerate(con.execute(f'SELECT * FROM "{table}"')):
                data = b"\0".join(v if isinstance(v, bytes) else str(v).encode() for v in row)
                if ours.intersection(UUID.findall(data)):
                    out[f"{table}:{n}"] = data
    return out
