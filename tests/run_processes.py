"""Find every process a test's subprocess started, by its session id (Linux /proc).

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
import time


def stat_of(pid: int | str) -> tuple[str, int, int, int]:
    """(state, ppid, process group, session) of a live process, from /proc/PID/stat (the command name in
    parentheses may hold spaces: the fields are read after its closing parenthesis)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])


def session_processes(session_id: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process (zombies excluded) of this session. Plain reads of /proc: the
    background runs' watchers call this twice a second for minutes."""
    found, me = [], str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            state, _, _, session = stat_of(name)
            if session == session_id and state not in ("Z", "X"):
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    found.append((int(name), f.read().replace(b"\0", b" ").decode()[:300]))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return found


def children_of(parent_pid: int) -> list[int]:
    """Pids of the live children of a process."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and stat_of(name)[1] == parent_pid:
                found.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def wait_until_gone(session_ids: list[int], timeout_s: float,
                    ignore: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """Wait until no process of these sessions is alive (processes whose command line starts with one of
    `ignore` do not count) -> what is left after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for sid in session_ids for p in session_processes(sid) if not p[1].startswith(ignore)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def reap(session_ids: list[int]) -> list[tuple[int, str]]:
    """SIGKILL every live process of these sessions -> what was alive."""
    left = [p for sid in session_ids for p in session_processes(sid)]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
