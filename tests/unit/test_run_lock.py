"""The run lock: one writer per run_dir / checkpoint location, a clear refusal naming the owner, and a lock
whose process was SIGKILLed free at once (the kernel drops the flock)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from spillover.flows.run_lock import FLOCK_NAME, LOCK_NAME, RunLockedError, acquire_run_lock, lock_locations
from spillover.infra.config.run_config import StorageConfig

REPO = Path(__file__).resolve().parents[2]


def _cfg(run_dir, storage_url: str = ""):
    """What the lock reads of a RunConfig: run_dir and storage.url."""
    return SimpleNamespace(run_dir=str(run_dir), storage=StorageConfig(url=storage_url))


def test_second_run_is_refused_with_the_owner_named_and_release_frees_it(tmp_path):
    cfg = _cfg(tmp_path / "run")
    first = acquire_run_lock(cfg, flow_run_id="11111111-1111-1111-1111-111111111111")
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert holder["flow_run_id"] == "11111111-1111-1111-1111-111111111111" and holder["host"] == socket.gethostname()
    with pytest.raises(RunLockedError, match=r"in use by flow run 11111111-1111-1111-1111-111111111111 \(pid "
                                             rf"{os.getpid()} on {socket.gethostname()}, since "):
        acquire_run_lock(cfg, flow_run_id="22222222-2222-2222-2222-222222222222")
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    second = acquire_run_lock(cfg, flow_run_id="33333333-3333-3333-3333-333333333333")
    first.release()  # not the owner any more: must not touch the second run's lock or record
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["flow_run_id"].startswith("3333")
    with pytest.raises(RunLockedError, match="flow run 3333"):
        acquire_run_lock(cfg)
    second.release()


_HOLDER = """
import sys, time
from spillover.flows.run_lock import acquire_run_lock
from types import SimpleNamespace
from spillover.infra.config.run_config import StorageConfig
lock = acquire_run_lock(SimpleNamespace(run_dir=sys.argv[1], storage=StorageConfig()), flow_run_id="crashed-run")
print("locked", flush=True)
time.sleep(120)
"""


def test_the_lock_of_a_sigkilled_run_is_free_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "run")], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pytest.raises(RunLockedError, match=f"flow run crashed-run \\(pid {holder.pid} "):
            acquire_run_lock(_cfg(tmp_path / "run"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # acquire_run_lock tries the flock once (timeout 0): it succeeds only if the kernel released the killed
    # holder's flock, with no staleness to wait out
    lock = acquire_run_lock(_cfg(tmp_path / "run"), flow_run_id="44444444-4444-4444-4444-444444444444")
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["flow_run_id"].startswith("4444")
    lock.release()


def test_local_checkpoint_location_outside_run_dir_is_locked_too(tmp_path):
    cfg = _cfg(tmp_path / "run", f"file://{tmp_path}/ckpt")
    assert lock_locations(cfg) == [(tmp_path / "run").resolve(), (tmp_path / "ckpt").resolve()]
    assert lock_locations(_cfg(tmp_path / "run", f"{tmp_path}/run/checkpoints")) == [
        (tmp_path / "run").resolve()]
    assert lock_locations(_cfg(tmp_path / "run", "s3://bucket/x")) == [(tmp_path / "run").resolve()]
    other = acquire_run_lock(_cfg(tmp_path / "other", f"file://{tmp_path}/ckpt"))
    with pytest.raises(RunLockedError, match="ckpt is in use"):
        acquire_run_lock(cfg)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # the run_dir lock taken first was given back
    assert acquire_run_lock(_cfg(tmp_path / "run")).locks[0].lock_file == str(tmp_path / "run" / FLOCK_NAME)
    other.release()


def test_the_lock_covers_the_folder_the_store_writes(tmp_path, monkeypatch):
    """~ expanded and file://relative read from the working directory, as open_store reads them."""
    from spillover.infra.storage.store import open_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for url in ("~/ckpts", "file://relative/ckpts", "relative/ckpts"):
        assert lock_locations(_cfg(tmp_path / "run", url))[1] == Path(open_store(url).root).resolve(), url
