"""Child processes that die with the process that started them, even when it is SIGKILLed (Linux).

`fate_shared(cmd)` -> the command wrapped in this file run as a script: `python -I -S fate_share.py PID -- CMD`.
The wrapper (a few MB, stdlib only) starts CMD and then waits on two pidfds, its parent's and CMD's:
- the parent process exits, by SIGKILL too -> CMD gets SIGTERM, SIGKILL after GRACE_S; the wrapper exits;
- CMD exits -> the wrapper exits with CMD's status (the same signal when CMD was killed by one);
- the wrapper gets SIGTERM/SIGHUP -> forwarded to CMD (so Popen.terminate() of the wrapper stops CMD);
- the wrapper is SIGKILLed -> the kernel SIGKILLs CMD (PR_SET_PDEATHSIG, set in CMD before exec).

Why not PR_SET_PDEATHSIG on CMD alone: the kernel sends that signal when the *thread* that forked the child
exits, not the process. The router is launched from an `asyncio.to_thread` worker and Prefect starts its
ephemeral server from whichever thread first needs the API; a thread pool shutting down would kill them
mid-run. The wrapper forks CMD from its own only thread, and watches its parent as a process (a pidfd is
readable once the whole process has exited).

On a kernel without pidfds (before 5.3) the wrapper polls its parent's pid every POLL_S instead; where
neither exists (not Linux), `fate_shared` returns the command unchanged.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys

GRACE_S = 5.0
POLL_S = 0.5  # without pidfds (kernels before 5.3)
PR_SET_PDEATHSIG = 1


def fate_shared(cmd: list[str], whole_group: bool = False) -> list[str]:
    """cmd, run so that it dies with this process (see the module docstring). whole_group=True: for a command
    that starts processes of its own (SGLang's server and its schedulers), started with start_new_session=True
    so that the wrapper leads a process group of its own: the parent's death signals that whole group."""
    if not hasattr(os, "pidfd_open") or not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
            *(["--group"] if whole_group else []), "--", *cmd]


def _kill_me_when_wrapper_dies(wrapper_pid: int) -> None:
    """preexec_fn of CMD (runs in the child between fork and exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(126)
    if os.getppid() != wrapper_pid:  # the wrapper died before prctl took effect
        os._exit(126)


def _exit_like(returncode: int) -> None:
    """Exit with CMD's status: the same code, or death by the same signal."""
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode if returncode >= 0 else 128 - returncode)


def _wait_for_either(parent_fd: int | None, parent_pid: int, child: subprocess.Popen) -> str:
    """Block until the parent process or the child exits -> "parent" or "child"."""
    if parent_fd is not None:
        child_fd = os.pidfd_open(child.pid)
        ready, _, _ = select.select([parent_fd, child_fd], [], [])
        return "child" if child_fd in ready else "parent"
    while True:
        try:
            child.wait(POLL_S)
            return "child"
        except subprocess.TimeoutExpired:
            if os.getppid() != parent_pid:  # reparented: the parent process has exited
                return "parent"


def _stop(child: subprocess.Popen, whole_group: bool) -> None:
    """SIGTERM, SIGKILL after GRACE_S: to the child, or to the wrapper's whole process group (itself last)."""
    if whole_group:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
    else:
        child.terminate()
    try:
        child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
    if whole_group:
        os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> None:
    whole_group = len(argv) > 1 and argv[1] == "--group"
    if whole_group:
        argv = argv[:1] + argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: fate_share.py PARENT_PID [--group] -- CMD [ARG...]")
    if whole_group and os.getpgrp() != os.getpid():  # killpg(0) would hit the caller's own group
        sys.exit("fate_share.py --group must lead its process group: start it with start_new_session=True")
    parent_pid, cmd = int(argv[0]), argv[2:]
    try:
        parent_fd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        sys.exit(125)
    except (AttributeError, OSError):  # no pidfds (a kernel before 5.3): poll the parent's pid instead
        parent_fd = None
    if os.getppid() != parent_pid:  # that pid is no longer our parent: it died before we looked
        sys.exit(125)
    wrapper_pid = os.getpid()
    child = subprocess.Popen(cmd, preexec_fn=lambda: _kill_me_when_wrapper_dies(wrapper_pid))
    # set after the fork: CMD keeps the default dispositions (an ignored signal would stay ignored across exec)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches CMD itself (same process group)
    if _wait_for_either(parent_fd, parent_pid, child) == "parent":
        _stop(child, whole_group)
    _exit_like(child.wait())


if __name__ == "__main__":
    main(sys.argv[1:])
