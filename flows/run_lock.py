"""One writer per run directory / checkpoint location: a lock file created atomically (O_CREAT | O_EXCL).

The lock file `.spillover.lock` holds who owns it: the Prefect flow run id (a uuid4 outside a flow run),
host, pid and start time. A second run on the same location fails at start with RunLockedError naming the
owner. A lock left by a crashed run is taken over when its owner is gone: its flow run is known to the
Prefect API in a final state, or, on the same host, its process is dead.
Takeover is serialised by a second exclusive file, so two runs cannot both take over one stale lock.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

LOCK_NAME = ".spillover.lock"


class RunLockedError(RuntimeError):
    """Another run holds the lock on this run directory or checkpoint location."""


@dataclass
class RunLock:
    paths: list[Path]
    owner: dict

    def release(self) -> None:
        """Remove the lock files that are still ours (never another run's)."""
        for path in self.paths:
            if _read(path).get("lock_id") == self.owner["lock_id"]:
                path.unlink(missing_ok=True)


def lock_locations(cfg) -> list[Path]:
    """run_dir, plus storage.url when it is a local directory outside run_dir. Remote (s3://) checkpoint
    locations are covered by the run_dir lock only: use one run_dir per checkpoint location."""
    run_dir = Path(cfg.run_dir).resolve()
    out = [run_dir]
    url = cfg.storage.url
    if url:
        parsed = urlparse(url)
        if parsed.scheme in ("", "file"):
            local = Path(parsed.path if parsed.scheme else url).resolve()
            if local != run_dir and run_dir not in local.parents:
                out.append(local)
    return out


def current_flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


def acquire_run_lock(cfg, flow_run_id: str | None = None, is_stale=None) -> RunLock:
    """Lock every location of this run (see lock_locations), or raise RunLockedError with the owner."""
    owner = {"lock_id": uuid.uuid4().hex, "flow_run_id": flow_run_id or current_flow_run_id(),
             "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    is_stale = is_stale or owner_is_gone
    taken: list[Path] = []
    try:
        for location in lock_locations(cfg):
            location.mkdir(parents=True, exist_ok=True)
            path = location / LOCK_NAME
            _acquire_one(path, owner, is_stale)
            taken.append(path)
    except BaseException:
        RunLock(taken, owner).release()
        raise
    return RunLock(taken, owner)


def _acquire_one(path: Path, owner: dict, is_stale) -> None:
    if _create_exclusive(path, owner):
        return
    holder = _read(path)
    if not holder or not is_stale(holder):
        raise RunLockedError(_locked_message(path, holder))
    guard = path.with_name(path.name + ".takeover")
    if not _create_exclusive(guard, owner):
        raise RunLockedError(_locked_message(path, holder) + " (another run is taking the stale lock over right now)")
    try:
        if _read(path) == holder:  # still the stale owner's file, not a fresh lock from someone else
            path.unlink(missing_ok=True)
        if not _create_exclusive(path, owner):
            raise RunLockedError(_locked_message(path, _read(path)))
    finally:
        guard.unlink(missing_ok=True)


def _create_exclusive(path: Path, owner: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(owner, fh)
    return True


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _locked_message(path: Path, holder: dict) -> str:
    who = (f"flow run {holder.get('flow_run_id')} (pid {holder.get('pid')} on {holder.get('host')}, since "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started_at', 0)))})"
           if holder else "an unknown run")
    return (f"{path.parent} is in use by {who}: two runs must not write the same run_dir / checkpoint location. "
            f"Wait for it to finish, pick another run_dir, or delete {path} if that run is certainly gone.")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def flow_run_state(flow_run_id: str):
    """The flow run's state (prefect State), or None when the API does not know that flow run."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(uuid.UUID(flow_run_id))
    except (ObjectNotFound, ValueError):
        return None
    return run.state


def owner_is_gone(holder: dict) -> bool:
    """Stale when its process on this host is dead, or its flow run is in a final state.

    A live process whose flow run the API does not know (another Prefect server) keeps its lock."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if not _pid_alive(holder["pid"]):
            return True
    if not holder.get("flow_run_id"):
        return False
    try:
        state = flow_run_state(holder["flow_run_id"])
    except Exception:  # API unreachable: the owner may be alive
        return False
    return state is not None and state.is_final()
