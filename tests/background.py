"""Background work (a pytest plugin): the suite's heaviest subprocess runs start with the session and run beside the
other tests at the lowest CPU priority, and the tests that check them run last.

Why: on 2 cores the suite leaves ~30% of the CPU idle (tests waiting on servers, sockets and processes; single-threaded
unit tests), while the kill -9 chains and the two-node placement cluster are CPU-bound subprocesses that depend on no
other test. At the lowest priority they take what the other tests leave, so the other tests keep their speed and their
time limits. Each background process leads a session whose autogroup gets nice 19 (`lower_priority`): with autogroup
scheduling (Linux's default, and this machine's) the CPU is shared between sessions first, and a process's own nice
only orders it within its session. Measured on 2 cores: plain `nice -n 19` (autogroups at 0) left the other tests up
to ~2x slower (the deployment test 81 s instead of ~45 s), and so did autogroups at nice 10 (the whole suite 519 s);
autogroups at nice 19: 420 s, the background done before the other tests. Starting a Ray node is the exception: Ray
gives a raylet 30 s to register (hard-coded), which a starved start can miss, so the steps that start one run at normal
priority and lower it afterwards (the background cluster, the placement cluster) or keep it (a run that starts its own
Ray).

A test marked `@pytest.mark.early("fixture", cpu_s=N)` names a session fixture (defined in a plugin, so that it is
visible from here) that only submits its work (`background.submit`) and returns the future; it is set up before the
first test, and the test, moved to the end of the session, waits for the result. The other tests run unit first, then
integration, then e2e (`run_order`); a background fixture that fails at set-up fails only the tests that use it. Runs
that would join a Ray cluster join the background one (`background.ray_address()`, tests/background_ray.py): Ray
starts its workers with the raylet's priority, and the session's cluster is not niced."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from run_processes import reap

NICE = 19
log = logging.getLogger(__name__)
TESTS = Path(__file__).resolve().parent


def lower_priority(pid: int) -> None:
    """Nice 19 for the process's session: its autogroup (every process of the session, later ones too) and, for
    kernels without autogroups, the process itself (children inherit it)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(NICE))
    except OSError:  # no autogroup scheduling in this kernel
        pass
    os.setpriority(os.PRIO_PROCESS, pid, NICE)


def start_background(args: list[str], lower: bool = True, **popen_kwargs) -> subprocess.Popen:
    """Popen(args) leading a new session, at low priority unless `lower` is False."""
    proc = subprocess.Popen(args, start_new_session=True, **popen_kwargs)
    if lower:
        lower_priority(proc.pid)
    return proc


def run_background(args: list[str], timeout_s: float, lower: bool = True, **popen_kwargs) -> tuple[int, str, str]:
    """start_background(args), then wait for it -> (returncode, stdout, stderr); on timeout its whole session is
    SIGKILLed (returncode -9)."""
    proc = start_background(args, lower=lower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reap([proc.pid])
        out, err = proc.communicate()
    return proc.returncode, out, err


class BackgroundWork:
    """Two worker threads for the background jobs (each job runs subprocesses one after the other: two at a time keep
    the spare CPU busy without holding the memory of more), and the background Ray cluster, started on first use."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="background")
        self.stopping = threading.Event()  # set when the session ends: jobs stop between runs (e.g. after `pytest -x`)
        self._lock = threading.Lock()
        self._ray: subprocess.Popen | None = None
        self._ray_tmp = ""
        self._address = ""

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def ray_address(self) -> str:
        with self._lock:
            if self._ray is None:
                self._ray_tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths live under it
                env = {**os.environ, "RAY_TMPDIR": self._ray_tmp, "RAY_ADDRESS": "",
                       "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
                self._ray = start_background([sys.executable, str(TESTS / "background_ray.py")], lower=False, env=env,
                                             cwd=TESTS.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                self._address = self._ray.stdout.readline().strip()
                if not self._address:
                    raise RuntimeError(f"the background Ray cluster did not start (exit {self._ray.wait()})")
                lower_priority(self._ray.pid)  # its raylet and GCS, and the workers the raylet starts from now on
            return self._address

    def actors_of(self, driver_pids: list[int]) -> list[dict]:
        """The actors (ActorClassName, State, Pid) that the jobs of these drivers created in the background cluster."""
        with self._lock:
            assert self._ray is not None, "no run joined the background Ray cluster"
            self._ray.stdin.write(" ".join(map(str, driver_pids)) + "\n")
            self._ray.stdin.flush()
            return json.loads(self._ray.stdout.readline())

    def close(self) -> None:
        self.stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._ray is not None:
            self._ray.stdin.close()  # the helper shuts its Ray down
            try:
                self._ray.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            reap([self._ray.pid])  # whatever of its session is still there (nothing, when it shut down cleanly)
            self._ray.wait()
            shutil.rmtree(self._ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def background():
    work = BackgroundWork()
    try:
        yield work
    finally:
        work.close()


@pytest.fixture(scope="session", autouse=True)
def start_early_work(request):
    """Set up, before the first test, the fixtures that the session's `early` tests name: the most CPU first (their
    `cpu_s`), so that the short jobs, not a long one, are what is left when the other tests are done.

    A fixture that fails here fails only the tests that use it: pytest keeps a session fixture's error and raises it
    again in every test that asks for it (and for a fixture it depends on, e.g. the S3 server), while this autouse
    fixture, which every test runs, succeeds."""
    cpu_s = {m.args[0]: m.kwargs.get("cpu_s", 0) for item in request.session.items for m in item.iter_markers("early")}
    for name in sorted(cpu_s, key=cpu_s.get, reverse=True):
        try:
            request.getfixturevalue(name)
        except pytest.exit.Exception:
            raise
        except (Exception, pytest.skip.Exception, pytest.fail.Exception) as err:
            log.warning("background setup %r failed; the tests that use it will fail with: %r", name, err)


def pytest_configure(config):
    config.addinivalue_line("markers", "early(fixture, cpu_s=0): the fixture's background work (about cpu_s CPU "
                                       "seconds) starts with the session; the test runs last (tests/background.py)")


STAGES = {"unit": 0, "integration": 1, "gpu": 1, "e2e": 2}  # a test's folder -> its place in the session


def run_order(item) -> tuple[bool, int]:
    """Unit tests first (a broken pure function shows in seconds), then integration, then e2e; `early` tests last."""
    stage = next((STAGES[folder.name] for folder in item.path.parents if folder.name in STAGES), 1)
    return item.get_closest_marker("early") is not None, stage


def pytest_collection_modifyitems(items):
    items.sort(key=run_order)  # stable: within a stage, collection order
