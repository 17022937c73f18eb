"""Launch and drive the real `sglang-router` (pip package `sglang-router`) on loopback.

The router forwards /generate to its workers; it has no /abort_request (abort each worker directly).
Workers are added with POST /workers {"url"} and removed with DELETE /workers/{id}; both are
asynchronous in the router, so `add_worker` / `remove_worker` poll GET /workers until done.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ...infra.fate_share import fate_shared

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after timeout_s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def _parent_pid(proc_dir: Path) -> int | None:
    try:
        return int(proc_dir.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class Router:
    """A running sglang-router process. Build it with `Router.launch(...)`."""

    def __init__(self, url: str, proc: subprocess.Popen | None, log_path: Path | None = None):
        self.url, self.proc, self.log_path = url.rstrip("/"), proc, log_path
        self._http = httpx.Client(timeout=10.0)

    @classmethod
    def launch(cls, host: str = "127.0.0.1", port: int | None = None, policy: str = "round_robin",
               worker_urls: list[str] | None = None, timeout_s: float = 120.0,
               request_timeout_s: int = 3600, extra_args: list[str] | None = None) -> "Router":
        """Start the sglang-router (rollout/fleet/router_main.py) bound to host (router and prometheus ports free).
        It dies with this process, even a SIGKILLed one (infra/fate_share.py: `proc` is its small wrapper process).
        timeout_s bounds only a start that neither answers nor exits (an exit is reported at once): a starved start
        on a loaded machine took over 30 s (a low-priority kill chain of the test suite)."""
        port = port or free_port(host)
        prom_port = free_port(host)
        log_file = Path(tempfile.mkstemp(prefix=f"sglang_router_{port}_", suffix=".log")[1])
        cmd = [sys.executable, "-m", "spillover.rollout.fleet.router_main", "--host", host, "--port", str(port),
               "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(prom_port),
               "--request-timeout-secs", str(request_timeout_s), "--log-level", "warn",
               *(["--worker-urls", *worker_urls] if worker_urls else []), *(extra_args or [])]
        with open(log_file, "wb") as out:
            env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
            proc = subprocess.Popen(fate_shared(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env)
        router = cls(f"http://{host}:{port}", proc, log_file)
        try:
            router._wait_ready(timeout_s)
            for url in worker_urls or []:
                router._wait_listed(url, True, timeout_s)
        except Exception:
            router.stop()
            raise
        return router

    @property
    def pid(self) -> int | None:
        """The router's own pid (self.proc may be its wrapper, infra/fate_share.py); None when not ours."""
        if self.proc is None:
            return None
        children = [p for p in Path("/proc").glob("[0-9]*") if _parent_pid(p) == self.proc.pid]
        return int(children[0].name) if children else self.proc.pid

    @classmethod
    def connect(cls, url: str) -> "Router":
        """An external router (not ours to stop)."""
        router = cls(url, None)
        router._wait_ready(10.0)
        return router

    def _log_tail(self) -> str:
        if self.log_path and self.log_path.is_file():
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if self._http.get(self.url + "/workers", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"sglang-router at {self.url} not ready within {timeout_s} s:\n{self._log_tail()}")

    def _listing(self) -> list[dict]:
        resp = self._http.get(self.url + "/workers")
        resp.raise_for_status()
        return resp.json().get("workers", [])

    def workers(self) -> list[str]:
        """URLs of the registered workers."""
        return [w["url"] for w in self._listing()]

    def _wait_listed(self, url: str, listed: bool, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (url.rstrip("/") in self.workers()) == listed:
                return
            time.sleep(0.05)
        state = "listed" if listed else "removed"
        raise TimeoutError(f"worker {url} not {state} by the router {self.url} within {timeout_s} s:\n"
                           f"{self._log_tail()}")

    def add_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Register a worker and wait until the router lists it."""
        url = url.rstrip("/")
        if url in self.workers():
            return
        resp = self._http.post(self.url + "/workers", json={"url": url})
        if resp.status_code >= 400:
            raise RuntimeError(f"router refused worker {url}: {resp.status_code} {resp.text}")
        self._wait_listed(url, True, timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister a worker (by its URL) and wait until the router no longer lists it."""
        url = url.rstrip("/")
        ids = [w["id"] for w in self._listing() if w["url"] == url]
        for worker_id in ids:
            resp = self._http.delete(f"{self.url}/workers/{worker_id}")
            if resp.status_code >= 400 and resp.status_code != 404:
                raise RuntimeError(f"router refused to remove worker {url}: {resp.status_code} {resp.text}")
        self._wait_listed(url, False, timeout_s)

    def stop(self) -> None:
        self._http.close()
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
