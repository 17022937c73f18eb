"""Find every process a test's subprocess started, by its session id.

A subprocess started with `start_new_session=True` leads a new session whose id is its pid; every process
it starts inherits that session unless it calls setsid() itself. Nothing of a run does: Ray's raylet, GCS
and agents stay in the driver's session, its workers only change process group (checked on Ray 2.60), the
sglang-router and Prefect's server never touch it. Unlike an environment tag (which `sglang-router`
overwrites when it sets its process title) or a command line, a process cannot rewrite its session id,
and it survives reparenting to init when the session leader is SIGKILLed.
"""
from __future__ import annotations

import os
import signal

import psutil

from waiting import WaitTimedOut, wait_for


def session_processes(session_id: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process (zombies excluded) of this session. One getsid call per process
    and a look at the matching ones only: the background runs' watchers call this twice a second for minutes."""
    found, me = [], os.getpid()
    for pid in psutil.pids():
        try:
            if pid == me or os.getsid(pid) != session_id:
                continue
            proc = psutil.Process(pid)
            command = " ".join(proc.cmdline())[:300]
            # an exiting process reads as '' before it turns zombie: it would hide the title it had
            if command and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                found.append((pid, command))
        except (ProcessLookupError, PermissionError, psutil.Error):  # gone meanwhile
            pass
    return found


def children_of(parent_pid: int) -> list[int]:
    """Pids of the live children of a process."""
    return sorted(child.pid for child in psutil.Process(parent_pid).children())


def wait_until_gone(session_ids: list[int], timeout_s: float,
                    ignore: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """Wait until no process of these sessions is alive (processes whose command line starts with one of
    `ignore` do not count) -> what is left after timeout_s ([] when all went)."""
    def left() -> list[tuple[int, str]]:
        return [p for sid in session_ids for p in session_processes(sid) if not p[1].startswith(ignore)]

    try:
        return wait_for(left, timeout_s, f"sessions {session_ids} gone", every=0.25, until=lambda found: not found)
    except WaitTimedOut as timed_out:
        return timed_out.last


def reap(session_ids: list[int]) -> list[tuple[int, str]]:
    """SIGKILL every live process of these sessions -> what was alive."""
    left = [p for sid in session_ids for p in session_processes(sid)]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
