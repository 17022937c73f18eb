"""The run lock: one writer per run_dir / checkpoint location, clear refusal, stale-lock takeover."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from flows.run_lock import LOCK_NAME, RunLockedError, acquire_run_lock, lock_locations, owner_is_gone
from infra.config import load_config


def _cfg(run_dir, *extra):
    return load_config("configs/tiny.yaml", [f"run_dir={run_dir}", *extra])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_run_is_refused_with_the_owner_named_and_release_frees_it(tmp_path):
    cfg = _cfg(tmp_path / "run")
    first = acquire_run_lock(cfg, flow_run_id="11111111-1111-1111-1111-111111111111", is_stale=lambda h: False)
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert holder["flow_run_id"] == "11111111-1111-1111-1111-111111111111" and holder["host"] == socket.gethostname()
    with pytest.raises(RunLockedError, match="in use by flow run 11111111-1111-1111-1111-111111111111"):
        acquire_run_lock(cfg, flow_run_id="22222222-2222-2222-2222-222222222222", is_stale=lambda h: False)
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    second = acquire_run_lock(cfg, is_stale=lambda h: False)
    first.release()  # not the owner any more: must not remove the second run's lock
    assert (tmp_path / "run" / LOCK_NAME).exists()
    second.release()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    cfg = _cfg(tmp_path / "run")
    (tmp_path / "run").mkdir()
    stale = {"lock_id": "old", "flow_run_id": None, "host": socket.gethostname(), "pid": _dead_pid(), "started_at": 0}
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps(stale))
    assert owner_is_gone(stale)
    lock = acquire_run_lock(cfg, flow_run_id="33333333-3333-3333-3333-333333333333")
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["lock_id"] == lock.owner["lock_id"]
    assert not (tmp_path / "run" / (LOCK_NAME + ".takeover")).exists()
    lock.release()


def test_live_or_foreign_owner_is_not_stale_and_takeover_in_progress_refuses(tmp_path):
    import os

    assert not owner_is_gone({"host": socket.gethostname(), "pid": os.getpid(), "flow_run_id": None})
    assert not owner_is_gone({"host": "another-host", "pid": 1, "flow_run_id": None})
    cfg = _cfg(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({"lock_id": "old", "pid": 1, "host": "h"}))
    (tmp_path / "run" / (LOCK_NAME + ".takeover")).write_text("{}")
    with pytest.raises(RunLockedError, match="taking the stale lock over"):
        acquire_run_lock(cfg, is_stale=lambda h: True)


def test_local_checkpoint_location_outside_run_dir_is_locked_too(tmp_path):
    cfg = _cfg(tmp_path / "run", f"storage.url=file://{tmp_path}/ckpt")
    assert lock_locations(cfg) == [(tmp_path / "run").resolve(), (tmp_path / "ckpt").resolve()]
    assert lock_locations(_cfg(tmp_path / "run", f"storage.url={tmp_path}/run/checkpoints")) == [
        (tmp_path / "run").resolve()]
    assert lock_locations(_cfg(tmp_path / "run", "storage.url=s3://bucket/x")) == [(tmp_path / "run").resolve()]
    other = acquire_run_lock(_cfg(tmp_path / "other", f"storage.url=file://{tmp_path}/ckpt"), is_stale=lambda h: False)
    with pytest.raises(RunLockedError, match="ckpt is in use"):
        acquire_run_lock(cfg, is_stale=lambda h: False)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # the run_dir lock taken first was given back
    other.release()
