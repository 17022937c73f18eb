"""Kill -9 and resume, end to end: `spillover train` as a subprocess SIGKILLs itself when a chosen task of
iteration 1 starts (SPILLOVER_KILL_AT, infra/faults.py), `spillover resume RUN_DIR` finishes the run, and
the result is the uninterrupted run's: every prompt group trained exactly once and the final checkpoint's
policy tensors (weights, AdamW state, torch RNG) bit-identical.

Determinism needs three settings (DETERMINISTIC below): rollout.deterministic_sampling (every request
carries a sampling_seed, so tokens do not depend on batching, timing or the engine; tested in
tests/integration/test_seeded_sampling.py), and old logprobs from the learner without truncated IS (grpo.skip_old_logprob=false, grpo.tis=false): the CPU engine's logprobs
are equal only up to ~1e-7 across batch compositions, which would reach the weights through the loss.

The killed run must leave no process behind: each subprocess gets a unique SPILLOVER_PROC_TAG in its
environment, which every descendant inherits (Ray's raylet and workers, engine actors, the router), and
/proc is searched for it. Found on these machines: Ray's workers and agents (engine actors, an idle
worker, the dashboard and runtime-env agents) outlive the SIGKILL by a few seconds and then exit on their
own -- except Ray's dashboard and runtime-env agents: they notice the raylet's death at once, then block
for Ray's hard-coded 60 s trying to report it to the (dead) GCS, and exit. So each test requires every
other process of the killed run (raylet, GCS, workers, engines, learners, router) to be gone within
LEFTOVER_GRACE_S, and the module's teardown requires the agents to be gone too (AGENT_GRACE_S, counted
from the kill; by then it has long passed). Whatever is still there is SIGKILLed and fails the test.

All subprocesses share one Prefect server (prefect_test_harness, started once for the module): an
ephemeral server per process costs ~10-25 s here and timed out under load.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from small_run import SMALL_RUN

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TAG_ENV = "SPILLOVER_PROC_TAG"
SEVEN_TASKS = ["load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob",
               "compute_old_logprob", "update", "clear_and_age_sort"]
SMALL = ["schedule.num_iterations=3", *SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false",
         "engines.rollout_num_gpus=1"]
DETERMINISTIC = ["rollout.deterministic_sampling=true", "grpo.skip_old_logprob=false", "grpo.tis=false",
                 "grpo.reward_function_path=test_kill_resume.distinct_chars"]
LEFTOVER_GRACE_S = 30.0
AGENT_GRACE_S = 90.0
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # exit ~60 s after the raylet dies (see above)


def distinct_chars(response: str, label, **_) -> float:
    """A reward that varies within a group (the tiny model never solves the built-in task), so that every
    update moves the weights and a wrong resume would show in them."""
    return len(set(response)) / 16.0


# ---- the kill -9 matrix ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One Prefect server for every subprocess of this module -> (API URL, its SQLite database file)."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        db = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
        yield PREFECT_API_URL.value(), Path(db.split(":///", 1)[-1]) if ":///" in db else None


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries this run's tag."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes() and (proc / "stat").read_text().split()[2] != "Z":
                found.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def wait_until_gone(tags: list[str], timeout_s: float, ignore: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """Wait until no process of these tags is alive (processes whose command line starts with one of
    `ignore` do not count) -> what is left after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for tag in tags for p in tagged_processes(tag) if not p[1].startswith(ignore)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


class Spillover:
    """Runs `spillover ...` subprocesses for one test, each in its own session with a unique process tag;
    `reap()` (teardown) SIGKILLs whatever of theirs is still alive."""

    def __init__(self, prefect_api_url: str, tmp_path: Path, all_tags: list[str]):
        self.api_url, self.tmp_path, self.tags, self.logs = prefect_api_url, tmp_path, [], []
        self.all_tags = all_tags  # the module's, for the final check of Ray's agents

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_ADDRESS", "AWS_",
                                                                          "SPILLOVER_"))}
        env.update(PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.tmp_path / "prefect-home"),
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]),
                                               env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, args: list[str], timeout_s: float = 600, **env_extra) -> tuple[subprocess.CompletedProcess, str]:
        tag = uuid.uuid4().hex
        self.tags.append(tag)
        self.all_tags.append(tag)
        log = self.tmp_path / f"spillover-{len(self.tags)}-{args[0]}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            proc = subprocess.run([str(BIN / "spillover"), *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  env=self.env(**{TAG_ENV: tag}, **env_extra), timeout=timeout_s,
                                  start_new_session=True)
        return proc, tag

    def output(self, index: int = -1) -> str:
        return self.logs[index].read_text(errors="replace")

    def reap(self) -> list[tuple[int, str]]:
        return reap(self.tags)


def reap(tags: list[str]) -> list[tuple[int, str]]:
    """SIGKILL every live process of these tags (each one a descendant of a subprocess this module started)."""
    left = [p for tag in tags for p in tagged_processes(tag)]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(scope="module")
def all_tags():
    """Every subprocess tag of the module; at the end none of their processes may be left, Ray's agents
    included."""
    tags: list[str] = []
    yield tags
    left = wait_until_gone(tags, AGENT_GRACE_S)
    reap(tags)
    assert left == [], f"processes of killed runs still alive at the end of the module: {left}"


@pytest.fixture
def spillover(prefect_api, all_tags, tmp_path):
    runner = Spillover(prefect_api[0], tmp_path, all_tags)
    yield runner
    runner.reap()


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *DETERMINISTIC, *extra]


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_state(url: str, storage_cfg=None):
    from infra.checkpoint import load_latest_checkpoint
    from infra.storage import open_store

    return load_latest_checkpoint(open_store(url, storage_cfg))


@pytest.fixture(scope="module")
def reference(prefect_api, all_tags, tmp_path_factory):
    """The uninterrupted run: its metrics rows and the final checkpoint."""
    tmp = tmp_path_factory.mktemp("reference")
    runner = Spillover(prefect_api[0], tmp, all_tags)
    try:
        proc, tag = runner.run(train_args(tmp / "run"))
        assert proc.returncode == 0, runner.output()[-4000:]
        assert wait_until_gone([tag], LEFTOVER_GRACE_S) == []
    finally:
        runner.reap()
    rows = metrics_rows(tmp / "run")
    state = final_state(str(tmp / "run" / "checkpoints"))
    assert [r["iteration"] for r in rows] == [0, 1, 2] and state.iteration == 2
    assert len({r["loss"] for r in rows}) > 1 and rows[0]["grad_norm"] > 0  # the weights really move
    return rows, state


def assert_same_as_reference(run_dir: Path, state, reference) -> None:
    ref_rows, ref_state = reference
    rows = metrics_rows(run_dir)
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


def kill_and_resume(spillover: Spillover, run_dir: Path, kill_at: str, train_extra=(), resume_extra=(),
                    before_resume=None, **env_extra) -> None:
    """Train with SPILLOVER_KILL_AT=kill_at (must die by SIGKILL, leaving nothing behind), run
    before_resume() if given, then `spillover resume` (must finish)."""
    killed, tag = spillover.run(train_args(run_dir, *train_extra), SPILLOVER_KILL_AT=kill_at, **env_extra)
    assert killed.returncode == -signal.SIGKILL, spillover.output()[-4000:]
    if before_resume is not None:
        before_resume()
    left = wait_until_gone([tag], LEFTOVER_GRACE_S, ignore=RAY_AGENTS)
    assert left == [], f"the killed run left processes behind after {LEFTOVER_GRACE_S:.0f} s: {left}"
    resumed, tag = spillover.run(["resume", str(run_dir), *resume_extra], **env_extra)
    assert resumed.returncode == 0, spillover.output()[-4000:]
    assert wait_until_gone([tag], LEFTOVER_GRACE_S) == []


def assert_checkpoints(url: str, expected: list[tuple[int, bool]], storage_cfg=None) -> None:
    """(iteration, has a manifest) of every checkpoint prefix at url."""
    from infra.checkpoint import list_checkpoints
    from infra.storage import open_store

    assert [(c.iteration, c.complete) for c in list_checkpoints(open_store(url, storage_cfg))] == expected


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("task", SEVEN_TASKS)
def test_kill_9_at_task_start_then_resume_matches_uninterrupted(task, reference, spillover, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = str(run_dir / "checkpoints")
    kill_and_resume(spillover, run_dir, f"{task}:1",
                    before_resume=lambda: assert_checkpoints(checkpoints, [(0, True)]))  # iteration 1 is redone
    assert_same_as_reference(run_dir, final_state(str(run_dir / "checkpoints")), reference)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_s3_kill_9_between_objects_and_manifest_then_resume_without_leaking_credentials(
        s3_server, reference, spillover, prefect_api, tmp_path):
    """Checkpoints on the real S3 server (keys given as config values to `train`, from the environment to
    `resume`, since config.json never holds them). The kill comes in iteration 1's checkpoint write, after
    every object and before the manifest: that half-written checkpoint is never loaded, resume starts from
    iteration 0's and the end is still the uninterrupted run's. Neither key appears in the run directory,
    the processes' output, the checkpoint objects or the Prefect database (parameters, logs, artifacts)."""
    run_dir = tmp_path / "run"
    url = s3_server.url(f"kill-resume-{uuid.uuid4().hex[:8]}")
    s3_cfg = s3_server.storage_config()
    location = [f"storage.url={url}", f"storage.endpoint_url={s3_server.endpoint_url}", "storage.region=us-east-1"]
    keys = [f"storage.access_key_id={s3_server.access_key}", f"storage.secret_access_key={s3_server.secret_key}"]
    kill_and_resume(spillover, run_dir, "checkpoint_manifest:1", train_extra=location + keys,
                    before_resume=lambda: assert_checkpoints(url, [(0, True), (1, False)], s3_cfg),
                    AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key)
    state = final_state(url, s3_cfg)
    assert_same_as_reference(run_dir, state, reference)
    assert_checkpoints(url, [(1, True), (2, True)], s3_cfg)

    from infra.storage import open_store

    store = open_store(url, s3_cfg)
    texts = {str(p): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    texts.update({str(log): log.read_bytes() for log in spillover.logs})
    texts.update({f"{url}/ckpt-{i:08d}/{name}": store.get_bytes(f"ckpt-{i:08d}/{name}")
                  for i in (1, 2) for name in ("meta.json", "manifest.json")})
    db = prefect_api[1]
    assert db is not None and db.is_file()
    texts.update({str(p): p.read_bytes() for p in db.parent.glob(db.name + "*")})  # the db and its -wal
    assert str(run_dir / "config.json") in texts
    assert any(url.encode() in data for name, data in texts.items() if ".db" in name)  # the flow's config is there
    for secret in (s3_server.secret_key, s3_server.access_key):
        leaked = [name for name, data in texts.items() if secret.encode() in data]
        assert leaked == [], f"a storage credential is in {leaked}"
