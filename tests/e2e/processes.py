"""Child processes for e2e tests: started in their own session (and process group) on 127.0.0.1, output to a
log file, stopped with SIGTERM to the whole group and SIGKILL after a timeout, then SIGKILL to whatever of
the session is left, even when the test fails."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

import httpx
from run_processes import reap
from waiting import WaitTimedOut, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL it if anything is left after timeout_s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children (flow-run subprocesses, Ray) may outlive the leader
    except ProcessLookupError:
        pass
    proc.wait(5)
    reap([proc.pid])  # and whatever left the process group (Ray's workers make their own) but not the session


@contextmanager
def running(cmd: list[str], log_path: Path, env: dict, cwd: str | None = None):
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc)
        log.close()


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
    """Until url answers 200 (proc, if given, must stay alive meanwhile)."""
    def status() -> int:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{_tail(log_path)}")
        return httpx.get(url, timeout=3).status_code

    try:
        wait_for(status, timeout_s, f"{url} answers 200", every=0.5, until=lambda code: code == 200,
                 not_yet=(httpx.HTTPError,))
    except WaitTimedOut as timed_out:
        raise TimeoutError(f"{timed_out}\n{_tail(log_path)}") from None


def _tail(path: Path | None, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path is not None and path.is_file() else ""
