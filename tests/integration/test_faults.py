"""Faults during a training run, in process with real parts (Ray actors, torch engines behind the real
sglang-router, the SeaweedFS S3 server, Prefect's test harness): the run goes on, or stops with a clear
message and resumes from the last checkpoint; every prompt group is trained exactly once either way.

- The S3 server stopped for a few seconds in the middle of a checkpoint write, twice in one run. SIGKILL and
  restart on the same ports: connections are refused and storage retries with backoff. SIGSTOP/SIGCONT: the
  kernel still accepts connections, so requests stall (no error and no retry: a call's time limit is over a
  minute) and complete once it runs again. Either way the checkpoint verifies and the run goes on.
- An engine actor SIGKILLed while it generates, in the same run as a reward function that raises on its
  first call (compute_reward has retries=1).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from test_train_flow import small_config
from waiting import wait_for

pytestmark = pytest.mark.timeout(900)
REWARD_CALLS = {"n": 0, "raised": 0}


def reward_raising_once(response: str, label, **_) -> float:
    """The built-in task's reward, but the first call of the run raises (a flaky remote scorer)."""
    from spillover.rollout.builtin.toy_task import reward

    REWARD_CALLS["n"] += 1
    if REWARD_CALLS["n"] == 1:
        REWARD_CALLS["raised"] += 1
        raise ConnectionError("reward service hiccup")
    return reward(response, label)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_each_group_trained_once(run_dir, iterations: int, gbs: int = 4) -> list[dict]:
    got = rows(run_dir)
    assert [r["iteration"] for r in got] == list(range(iterations))
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(iterations * gbs))
    return got


OUTAGE_S = 2.5  # longer than the first three backoffs together (0.2 + 0.4 + 0.8 s): several retries


class Records(logging.Handler):
    """The records of one logger, kept on the logger itself (pytest's caplog sits on the root logger, whose
    handlers logging configuration during a run may replace)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_s3_down_during_two_checkpoint_writes_the_run_goes_on(prefect_harness, ray_session, warm_parts,
                                                               outage_s3_server, monkeypatch, tmp_path):
    """One run, two outages of OUTAGE_S each, after the first object of a checkpoint: iteration 1's
    checkpoint meets a killed server (restarted on the same ports), iteration 2's a paused one."""
    import spillover.tasks.run_state as run_state
    from spillover.infra.storage.checkpoint import list_checkpoints, load_checkpoint
    from spillover.infra.storage.store import open_store
    from spillover.flows.train import grpo_train

    url = outage_s3_server.url(f"faults-{uuid.uuid4().hex[:8]}")
    cfg = small_config(tmp_path / "run", iterations=3, **{
        "storage.url": url, "storage.endpoint_url": outage_s3_server.endpoint_url, "storage.region": "us-east-1",
        "storage.access_key_id": outage_s3_server.access_key, "storage.secret_access_key": outage_s3_server.secret_key})
    server = outage_s3_server
    outages = {1: (server.kill, server.start), 2: (server.pause, server.resume)}
    real_save = run_state.save_checkpoint
    log: dict[int, dict] = {}
    timers: list[threading.Timer] = []

    def save_with_outage(store, state, **kwargs):
        if state.iteration not in outages:
            return real_save(store, state, **kwargs)
        stop, restart = outages[state.iteration]
        real_put = store.put_buffers
        seen = log.setdefault(state.iteration, {"written": 0})

        def put(key, buffers):  # the server goes away after the first object of this checkpoint
            if seen["written"] == 1 and "at" not in seen:
                seen["at"] = time.monotonic()
                stop()
                timers.append(threading.Timer(OUTAGE_S, restart))
                timers[-1].start()
            info = real_put(key, buffers)
            seen["written"] += 1
            return info
        store.put_buffers = put
        try:
            return real_save(store, state, **kwargs, workers=1)  # one object at a time: the outage hits mid-write
        finally:
            del store.put_buffers
            seen["done"] = time.monotonic()

    monkeypatch.setattr(run_state, "save_checkpoint", save_with_outage)
    storage_log, caplog = logging.getLogger("spillover.storage"), Records()
    storage_log.addHandler(caplog)
    try:
        summary = grpo_train(cfg, parts=warm_parts)
    finally:
        storage_log.removeHandler(caplog)
        for timer in timers:
            timer.join()
        outage_s3_server.start()  # a no-op when it is up
    assert summary["iterations"] == 3
    got = assert_each_group_trained_once(tmp_path / "run", 3)
    for iteration in (1, 2):  # the write waited each outage out
        assert log[iteration]["done"] - log[iteration]["at"] >= OUTAGE_S - 0.5
        assert got[iteration]["checkpoint_s"] >= OUTAGE_S - 0.5
    # refused connections are retried (a message per retry, naming the object, never a secret); a paused
    # server accepts connections, so its requests stall and complete without a retry
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) >= 2 and all(f"{url}/ckpt-00000001/" in m for m in retried), retried
    assert not any(outage_s3_server.secret_key in r.getMessage() for r in caplog.records)
    store = open_store(url, outage_s3_server.storage_config())
    assert [(c.iteration, c.complete) for c in list_checkpoints(store)] == [(1, True), (2, True)]
    for iteration in (1, 2):  # both checkpoints written through an outage verify
        assert load_checkpoint(store, iteration).meta["next_iteration"] == iteration + 1


def loads(url: str) -> int:
    return httpx.get(url + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"]


def test_engine_killed_mid_generation_and_reward_raising_once_run_completes(prefect_harness, ray_session, warm_parts,
                                                                            monkeypatch, tmp_path):
    """Engine 0's actor is SIGKILLed while it runs requests of the run's third generation round (after the
    first checkpoint): the router retries them on engine 1, and the manager restarts engine 0 with the
    current weights. The reward function raises once: the task is retried. The run completes with every
    group trained once."""
    from spillover.flows.train import grpo_train
    from spillover.rollout.fleet.manager import RolloutManager

    REWARD_CALLS.update(n=0, raised=0)
    cfg = small_config(tmp_path / "run", iterations=3, **{
        "rollout.max_tokens": 192, "rollout.max_model_len": 224,  # 96-token rounds: long enough to be caught
        "grpo.reward_function_path": "test_faults.reward_raising_once"})
    real_generate = RolloutManager.generate
    seen: dict = {"calls": 0}

    def kill_when_busy(manager: RolloutManager) -> None:
        victim = manager.engines[0]
        wait_for(lambda: loads(victim.url), 30, "engine 0 running a request", every=0.005, not_yet=(httpx.HTTPError,))
        os.kill(victim.pids[0], signal.SIGKILL)
        seen.update(killed_pid=victim.pids[0], killed_url=victim.url)

    def generate(self, batch, on_result=None):
        seen["calls"] += 1
        if seen["calls"] == 3:  # iteration 0 takes one or two rounds: this one comes after its checkpoint
            seen["killer"] = threading.Thread(target=kill_when_busy, args=(self,), daemon=True)
            seen["killer"].start()
            seen["manager"] = self
        return real_generate(self, batch, on_result)

    monkeypatch.setattr(RolloutManager, "generate", generate)
    summary = grpo_train(cfg, parts=warm_parts)
    seen["killer"].join(1)
    assert "killed_pid" in seen, "engine 0 was never seen generating: the kill did not happen"
    assert summary["iterations"] == 3
    assert REWARD_CALLS["raised"] == 1 and REWARD_CALLS["n"] > 1
    got = assert_each_group_trained_once(tmp_path / "run", 3)
    assert [r["weight_version"] for r in got] == [1, 2, 3]
    manager = seen["manager"]
    assert manager.restarts >= 1 or manager.engines[0].pids[0] != seen["killed_pid"]
