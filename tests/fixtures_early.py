"""Session fixtures of background work (tests/background.py): each submits a test's subprocess runs when the session
starts and returns their future; the test (`@pytest.mark.early("<fixture>", cpu_s=N)`, run last) waits for it.

The test-side helpers are imported when the fixture runs: their folders (tests/e2e) are on sys.path once pytest has
collected them, and a fixture is only set up for a collected test that names it."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from background import run_background
from spillover_runs import Spillover

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def kill_chain_runs(background, s3_server, prefect_harness, watch_until_gone, tmp_path_factory):
    """tests/e2e/test_kill_resume.py's two kill -9 chains."""
    from kill_chains import start_kill_chains

    return start_kill_chains(background, s3_server, prefect_harness, watch_until_gone,
                             tmp_path_factory.mktemp("kill-chains"))


@pytest.fixture(scope="session")
def sharded_killed_run(background, prefect_harness, watch_until_gone, tmp_path_factory):
    """tests/e2e/test_learner_group_kill.py's `spillover train` (learner.world_size=2) SIGKILLed at iteration 1's
    update -> (its runner, the run, its run_dir)."""
    from test_learner_group_kill import run_args

    tmp = tmp_path_factory.mktemp("sharded-kill")
    spillover, run_dir = Spillover(prefect_harness.api_url, tmp, nice=True), tmp / "killed"

    def job():
        args = ["train", "--config", "configs/tiny.yaml", *run_args(run_dir), "engines.rollout_num_gpus=1"]
        run = spillover.run(args, SPILLOVER_KILL_AT="update:1", RAY_ADDRESS=background.ray_address())
        watch_until_gone(run)
        return spillover, run, run_dir

    return background.submit(job)


@pytest.fixture(scope="session")
def async_killed_runs(background, prefect_harness, watch_until_gone, tmp_path_factory):
    """tests/e2e/test_async_kill_resume.py's `spillover train` runs (rollout.mode=async, without and with
    rollout.overlap), each SIGKILLed at iteration 1's update -> {overlap: future of (its runner, the run, its run_dir)}."""
    from test_async_kill_resume import async_args

    def job(overlap: bool, tmp):
        spillover, run_dir = Spillover(prefect_harness.api_url, tmp, nice=True), tmp / "async"
        run = spillover.run(async_args(run_dir, overlap), SPILLOVER_KILL_AT="update:1",
                            RAY_ADDRESS=background.ray_address())
        watch_until_gone(run)
        return spillover, run, run_dir

    # the folders are made here: tmp_path_factory is not safe to call from two of background's threads at once
    return {overlap: background.submit(job, overlap, tmp_path_factory.mktemp("async-kill")) for overlap in (False, True)}


@pytest.fixture(scope="session")
def placement_child(background, tiny_model_dir, s3_server, tmp_path_factory):
    """tests/integration/test_placement.py run as a script: its two-node Ray cluster's report (a dict)."""
    from spillover.infra.storage.store import open_store

    s3_url, storage = s3_server.url("models/placement"), s3_server.storage_config()
    store = open_store(s3_url, storage)
    for f in sorted(Path(tiny_model_dir).iterdir()):
        store.put_bytes(f.name, f.read_bytes())
    hub_home, commit = tmp_path_factory.mktemp("hf"), "c" * 40  # a Hub cache as huggingface_hub lays it out
    repo = hub_home / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    staging = {"url": s3_url, "endpoint_url": storage.endpoint_url,
               "cache_dir": str(tmp_path_factory.mktemp("model-cache")), "hub": {"repo_id": "org/tiny", "commit": commit}}
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}", "RAY_ADDRESS": "",
           "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1",  # the nodes' workers inherit them
           "AWS_ACCESS_KEY_ID": storage.access_key_id.get_secret_value(),  # the nodes' workers inherit them
           "AWS_SECRET_ACCESS_KEY": storage.secret_access_key.get_secret_value()}
    script = TESTS / "integration" / "test_placement.py"

    def job() -> dict:
        tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths live under it
        try:  # the child lowers its priority once its nodes are up (tests/background.py: Ray's 30 s)
            code, out, err = run_background([sys.executable, str(script), str(tiny_model_dir), json.dumps(staging)],
                                            600, lower=False, cwd=TESTS.parent, env={**env, "RAY_TMPDIR": tmp})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert code == 0 and lines, f"placement child failed ({code}):\n{err[-4000:]}"
        return json.loads(lines[-1])

    return background.submit(job)


@pytest.fixture(scope="session")
def unreachable_hub_check(background, tmp_path_factory):
    """tests/integration/test_hub_data.py's `spillover check` of a Hub file the Hub cannot be asked for (it waits out
    huggingface_hub's retries, ~23 s, mostly asleep) -> (future of (returncode, stdout, stderr), its folder, its
    HF_ENDPOINT)."""
    from test_hub_data import unreachable_check

    tmp = tmp_path_factory.mktemp("unreachable-hub")
    argv, env, endpoint = unreachable_check(tmp)
    return background.submit(run_background, argv, 300, cwd=TESTS.parent, env=env), tmp, endpoint


@pytest.fixture(scope="session")
def gpu_smoke_dry_run(background):
    """tests/integration/test_colocate.py's bench/gpu_smoke.py on CPU -> (returncode, stdout, stderr)."""
    from test_colocate import GPU_SMOKE_CPU_ARGS, WITHOUT_RAY_OR_PREFECT

    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    return background.submit(run_background, [sys.executable, "-c", WITHOUT_RAY_OR_PREFECT, *GPU_SMOKE_CPU_ARGS], 300,
                             cwd=TESTS.parent, env=env)
