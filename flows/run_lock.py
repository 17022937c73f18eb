"""One writer per run directory / checkpoint location: an exclusive flock (`filelock`) on `.spillover.flock`.

The kernel drops the lock when the process holding it dies (kill -9 included), so a lock left by a crashed run
is free again at once and the next run simply takes it. Who holds it is written, once the lock is taken, to
`.spillover.lock` (flow run id, host, pid, start time; removed at release, overwritten by the next owner
after a crash); a second run fails at start with RunLockedError naming that owner. The flock file itself
stays (deleting it would let a late opener lock an orphaned inode). flock holds across processes on one
host (and on NFS, where Linux maps it to locks the server keeps). An s3:// checkpoint location cannot be
flocked: it is covered by the run_dir lock only (use one run_dir per checkpoint location).
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_NAME = ".spillover.lock"  # the owner record
FLOCK_NAME = ".spillover.flock"  # the file the kernel locks


class RunLockedError(RuntimeError):
    """Another run holds the lock on this run directory or checkpoint location."""


@dataclass
class RunLock:
    locks: list[FileLock]
    owner: dict

    def release(self) -> None:
        """Remove our owner records (never another run's) and give the locks back; idempotent."""
        for lock in self.locks:
            owner_path = Path(lock.lock_file).with_name(LOCK_NAME)
            if lock.is_locked and _read(owner_path).get("lock_id") == self.owner["lock_id"]:
                owner_path.unlink(missing_ok=True)
            while lock.is_locked:
                lock.release()


def lock_locations(cfg) -> list[Path]:
    """run_dir, plus storage.url when it is a local directory outside run_dir. Remote (s3://) checkpoint
    locations are covered by the run_dir lock only: use one run_dir per checkpoint location."""
    from ..infra.storage.store import local_root

    run_dir = Path(cfg.run_dir).resolve()
    out = [run_dir]
    root = local_root(cfg.storage.url) if cfg.storage.url else None  # where the store itself writes
    if root is not None:
        local = Path(root).resolve()
        if local != run_dir and run_dir not in local.parents:
            out.append(local)
    return out


def current_flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


def acquire_run_lock(cfg, flow_run_id: str | None = None) -> RunLock:
    """Lock every location of this run (see lock_locations), or raise RunLockedError naming the owner."""
    owner = {"lock_id": uuid.uuid4().hex, "flow_run_id": flow_run_id or current_flow_run_id(),
             "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    held = RunLock([], owner)
    try:
        for location in lock_locations(cfg):
            location.mkdir(parents=True, exist_ok=True)
            lock = FileLock(location / FLOCK_NAME, thread_local=False)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                raise RunLockedError(_locked_message(location, _read(location / LOCK_NAME))) from None
            held.locks.append(lock)
            _write_owner(location / LOCK_NAME, owner)
    except BaseException:
        held.release()
        raise
    return held


def _write_owner(path: Path, owner: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{owner['lock_id'][:8]}")
    tmp.write_text(json.dumps(owner))
    os.replace(tmp, path)  # a reader sees the old owner or the new one, never half a file


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _locked_message(location: Path, holder: dict) -> str:
    who = (f"flow run {holder.get('flow_run_id')} (pid {holder.get('pid')} on {holder.get('host')}, since "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started_at', 0)))})"
           if holder else "a run that is just starting")
    return (f"{location} is in use by {who}: two runs must not write the same run_dir / checkpoint location. "
            "Wait for it to finish or pick another run_dir (the lock is freed as soon as its process exits).")
