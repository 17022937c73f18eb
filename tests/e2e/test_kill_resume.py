"""Kill -9 and resume, end to end: `spillover train` / `spillover resume` as subprocesses that SIGKILL
themselves at a chosen point of iteration 1 (SPILLOVER_KILL_AT through the kill_hook test plugin), and the
end is the uninterrupted run's: every prompt group trained exactly once and the final checkpoint's policy
tensors (weights, AdamW state, torch RNG) bit-identical.

Chains cover the whole matrix. Each task kill point (the start of each of the iteration's tasks) leaves
the same durable state, checkpoint 0, so a chain is: `train` killed at one task start of iteration 1, then
`resume` killed at the next one, and so on, then a `resume` that finishes. Each resume starts from what the
previous kill left, so a kill that damaged durable state shows in the final comparison, and the state is
checked after every kill too. One process start per kill point instead of two. The kill points are split
between two chains that run side by side with the uninterrupted reference run (in the test's process, on the
session's warm parts):
- on the real S3 server, ending with a kill in iteration 1's checkpoint write after every object and before
  the manifest (a half-written checkpoint that must never be loaded). Keys go as config values to `train`
  and from the environment to every `resume` (config.json never holds them), and at the end neither key
  appears in the run directory, the processes' output, the checkpoint objects or the Prefect database
  (parameters, logs, artifacts);
- on local files, with the engine colocated in the learner's process (placement.colocate): the kills then also
  fall between its release and its resume, and the run must still end as the reference run, whose engines are
  their own actors.
The first run of the S3 chain and the last run of the file chain start their own local Ray, as `spillover` does by
default: a killed driver's local Ray (GCS, raylet, agents, workers) must go with it, and a finished run's too (one
Ray start per chain keeps the chains equally long). The other runs join
the session's Ray cluster (RAY_ADDRESS, as on a real cluster), which saves a Ray start per run: Ray must end each
killed driver's job, so every actor those runs created is dead and its worker process gone soon after the
chains end (read from the GCS). How a local Ray dies does not depend on where its driver was killed; the
durable state is checked at every kill point either way.

Determinism needs three settings (DETERMINISTIC below): rollout.deterministic_sampling (every request
carries a sampling_seed, so tokens do not depend on batching, timing or the engine; tested in
tests/integration/test_seeded_sampling.py), and old logprobs from the learner without truncated IS
(grpo.skip_old_logprob=false, grpo.tis=false): the CPU engine's logprobs are equal only up to ~1e-7
across batch compositions, which would reach the weights through the loss.

No run may leave a process behind (tests/e2e/spillover_runs.py checks each run's session and, for runs that joined
the session's cluster, their actors). The test requires the router to have been seen in every run and the ephemeral
Prefect server in the one run that uses it (the S3 chain's second link; the others share the session's Prefect
server). Leftovers of a link are checked while the next link already runs.
"""
from __future__ import annotations

import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fixtures_prefect import copy_migrated_database
from small_run import SMALL_RUN
from spillover_runs import (PREFECT_SERVER, RAY_AGENTS, ROUTER, Spillover, assert_joined_runs_left_nothing,  # noqa: F401
                            metrics_rows, spillover, watch_until_gone)  # (fixtures)

TASK_KILLS = ["load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob",
              "compute_old_logprob", "update", "clear_and_age_sort", "save_checkpoint"]  # every task of the iteration
EPHEMERAL_LINK = 1  # this link's run starts its own Prefect server (none given): it must die with the run
SMALL = ["schedule.num_iterations=3", *SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false",
         "engines.rollout_num_gpus=1"]
DETERMINISTIC = ["rollout.deterministic_sampling=true", "grpo.skip_old_logprob=false", "grpo.tis=false",
                 "grpo.reward_function_path=test_kill_resume.distinct_chars"]


def distinct_chars(response: str, label, **_) -> float:
    """A reward that varies within a group (the tiny model never solves the built-in task), so that every
    update moves the weights and a wrong resume would show in them."""
    return len(set(response)) / 16.0


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *DETERMINISTIC, *extra]


def final_state(url: str, storage_cfg=None):
    from infra.checkpoint import load_latest_checkpoint
    from infra.storage import open_store

    return load_latest_checkpoint(open_store(url, storage_cfg))


def assert_checkpoints(url: str, expected: list[tuple[int, bool]], storage_cfg=None, after: str = "") -> None:
    """(iteration, has a manifest) of every checkpoint prefix at url."""
    from infra.checkpoint import list_checkpoints
    from infra.storage import open_store

    got = [(c.iteration, c.complete) for c in list_checkpoints(open_store(url, storage_cfg))]
    assert got == expected, after


def assert_same_as_reference(run_dir: Path, state, ref_dir: Path, ref_state) -> None:
    rows, ref_rows = metrics_rows(run_dir), metrics_rows(ref_dir)
    assert [r["iteration"] for r in ref_rows] == [0, 1, 2] and ref_state.iteration == 2
    assert len({r["loss"] for r in ref_rows}) > 1 and ref_rows[0]["grad_norm"] > 0  # the weights really move
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    trained = [g for r in rows for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(12)), trained  # every group exactly once over the whole run
    for key in ("trained_stream_ids", "trained_group_ids", "reward_mean", "response_length_p50", "weight_version"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    assert state.iteration == ref_state.iteration == 2
    got, want = state.tensors["policy"], ref_state.tensors["policy"]
    assert sorted(got) == sorted(want)
    differing = [name for name in want if not torch.equal(got[name], want[name])]
    assert differing == [], f"{len(differing)} tensors differ from the uninterrupted run, e.g. {differing[:3]}"
    assert state.meta["cursor"] == ref_state.meta["cursor"]


def kill_chain(spillover: Spillover, run_dir: Path, url: str, storage_cfg, first_args: list[str],
               kills: list[tuple[str, list[tuple[int, bool]]]], ray_address: str, own_ray: tuple[int, ...] = (),
               ephemeral_link: int | None = None, migrated_db: Path | None = None, **env) -> None:
    """`train` (first_args) killed at kills[0], then `resume` killed at each further point, then a `resume` that
    finishes; after each kill, the checkpoints at url are the given (iteration, complete) list. Links numbered
    in own_ray (-1: the last, finishing one) start their own local Ray; the others join ray_address. The
    ephemeral link's Prefect server starts on a copy of migrated_db (an empty database costs ~100 migrations,
    ~8 s on 2 cores; what is checked is that the server dies with the run)."""
    previous = None
    links = [*kills, (None, [(1, True), (2, True)])]
    own_ray = {link % len(links) for link in own_ray}
    for link, (kill_at, left_behind) in enumerate(links):
        args = first_args if link == 0 else ["resume", str(run_dir)]
        last = link == len(links) - 1
        ray = {} if link in own_ray else {"RAY_ADDRESS": ray_address}
        kill = {} if last else {"SPILLOVER_KILL_AT": kill_at}
        if link == ephemeral_link and migrated_db is not None:
            copy_migrated_database(migrated_db, spillover.prefect_home)
        run = spillover.run(args, ephemeral_prefect=link == ephemeral_link, **kill, **ray, **env)
        if last:
            assert run.returncode == 0, spillover.output(run)
        else:
            assert run.returncode == -signal.SIGKILL, f"{kill_at}: {spillover.output(run)}"
        assert run.saw(ROUTER), (kill_at, run.seen)
        if link == ephemeral_link:
            assert run.saw(PREFECT_SERVER), (kill_at, run.seen)
        assert_checkpoints(url, left_behind, storage_cfg, after=f"kill at {kill_at}")
        if previous is not None:  # checked now: its processes had the whole of this run to exit
            spillover.check_gone(previous, ignore=RAY_AGENTS)
        previous = run
    spillover.check_gone(previous)


def run_reference(ref_dir: Path) -> None:
    """The uninterrupted run, in this process on the session's warm parts (tests/fixtures_warm.py: a run on
    kept parts trains bit for bit like one on new parts) instead of one more `spillover train` process."""
    from flows.train import grpo_train
    from infra.config import load_config

    # two engines (the shape the suite's warm parts have) where the chains have one: seeded sampling makes the
    # tokens independent of the engine count, so the comparison also checks that
    grpo_train(load_config("configs/tiny.yaml", [f"run_dir={ref_dir}", *SMALL, *DETERMINISTIC,
                                                 "engines.rollout_num_gpus=2"]))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_9_at_every_point_then_resume_matches_uninterrupted_and_leaks_nothing(
        s3_server, spillover, prefect_harness, ray_session, warm_parts, tmp_path):
    """Two chains side by side (the kill points split between them, one on S3 and one on local files) and the
    uninterrupted reference run alongside, in this process: three runs at once keep both cores busy."""
    s3_dir, file_dir, ref_dir = tmp_path / "s3-run", tmp_path / "file-run", tmp_path / "reference"
    url = s3_server.url(f"kill-resume-{uuid.uuid4().hex[:8]}")
    s3_cfg = s3_server.storage_config()
    location = [f"storage.url={url}", f"storage.endpoint_url={s3_server.endpoint_url}", "storage.region=us-east-1"]
    keys = [f"storage.access_key_id={s3_server.access_key}", f"storage.secret_access_key={s3_server.secret_key}"]
    aws = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    ray_address = ray_session.get_runtime_context().gcs_address  # the runs without their own Ray join it
    task_kills = [(f"{task}:1", [(0, True)]) for task in TASK_KILLS]
    half = len(task_kills) // 2
    with ThreadPoolExecutor(2) as pool:
        s3_chain = pool.submit(kill_chain, spillover, s3_dir, url, s3_cfg, train_args(s3_dir, *location, *keys),
                               task_kills[:half] + [("checkpoint_manifest:1", [(0, True), (1, False)])],
                               ray_address, own_ray=(0,), ephemeral_link=EPHEMERAL_LINK,
                               migrated_db=prefect_harness.database, **aws)
        file_chain = pool.submit(kill_chain, spillover, file_dir, str(file_dir / "checkpoints"), None,
                                 train_args(file_dir, "placement.colocate=true"), task_kills[half:], ray_address,
                                 own_ray=(-1,))
        run_reference(ref_dir)  # meanwhile, in this thread (the warm parts are this context's)
        s3_chain.result()
        file_chain.result()
    assert_joined_runs_left_nothing()
    ref_state = final_state(str(ref_dir / "checkpoints"))
    assert_same_as_reference(s3_dir, final_state(url, s3_cfg), ref_dir, ref_state)
    assert_same_as_reference(file_dir, final_state(str(file_dir / "checkpoints")), ref_dir, ref_state)
    assert_no_credentials(s3_dir, spillover, url, s3_server, prefect_harness.database)


def assert_no_credentials(run_dir: Path, spillover: Spillover, url: str, s3_server, db: Path | None) -> None:
    from infra.storage import open_store

    store = open_store(url, s3_server.storage_config())
    texts = {str(p): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    texts.update({str(run.log): run.log.read_bytes() for run in spillover.runs})
    texts.update({f"{url}/ckpt-{i:08d}/{name}": store.get_bytes(f"ckpt-{i:08d}/{name}")
                  for i in (1, 2) for name in ("meta.json", "manifest.json")})
    assert db is not None and db.is_file()
    texts.update({str(p): p.read_bytes() for p in db.parent.glob(db.name + "*")})  # the db and its -wal
    assert str(run_dir / "config.json") in texts
    assert any(url.encode() in data for name, data in texts.items() if ".db" in name)  # the flow's config is there
    for secret in (s3_server.secret_key, s3_server.access_key):
        leaked = [name for name, data in texts.items() if secret.encode() in data]
        assert leaked == [], f"a storage credential is in {leaked}"
