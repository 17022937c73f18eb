"""`spillover` subprocesses for the e2e tests, and the checks that they leave nothing behind.

Each run leads its own session, and every process it starts stays in that session (tests/run_processes.py): Ray's
GCS, raylet, agents and workers when it starts its own Ray, engine and learner actors, the sglang-router (which
overwrites its environment with its process title, so an environment tag misses it) and Prefect's ephemeral
server. While a run is alive its session is sampled (`Run.saw`). After it ends, every process of its session must be
gone within LEFTOVER_GRACE_S -- except Ray's dashboard and runtime-env agents after a SIGKILL: they notice the
raylet's death at once, then block for Ray's hard-coded 60 s trying to report it to the (dead) GCS, and exit; they
must be gone within AGENT_GRACE_S of the kill (`watch_until_gone`, in the background while the suite goes on;
whatever is still there at a deadline is SIGKILLed and fails the suite). Runs that join the session's Ray cluster
(RAY_ADDRESS) leave actors in it instead: `assert_joined_runs_left_nothing` reads them from the GCS.

A pytest plugin (tests/conftest.py): the background runs' fixtures (tests/fixtures_early.py) use its fixtures too.
`Spillover(..., nice=True)` starts its runs at a low CPU priority (tests/background.py)."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import psutil
from background import start_background
from run_processes import reap, session_processes, wait_until_gone
from waiting import WaitTimedOut, wait_for

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
BIN = Path(sys.executable).parent
LEFTOVER_GRACE_S = 30.0
AGENT_GRACE_S = 90.0
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # exit ~60 s after the raylet dies (see above)
ROUTER = "sglang::router"  # its process title
PREFECT_SERVER = "prefect.server.api.server:create_app"


@dataclass
class Run:
    """One `spillover` subprocess: its session id (= its pid), what was seen in its session while it ran,
    and when it ended."""
    args: list[str]
    log: Path
    session: int = 0
    returncode: int | None = None
    ended: float = 0.0
    seen: dict[int, str] = field(default_factory=dict)

    def saw(self, needle: str) -> bool:
        return any(needle in cmd for cmd in self.seen.values())


class Spillover:
    """Runs `spillover ...` subprocesses, each leading its own session; `check_gone` / `reap` find their
    processes by that session."""

    def __init__(self, prefect_api_url: str, tmp_path: Path, nice: bool = False):
        self.api_url, self.tmp_path, self.runs, self.count = prefect_api_url, tmp_path, [], itertools.count(1)
        self.nice = nice
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.prefect_home = tmp_path / "prefect-home"  # every run's PREFECT_HOME (an ephemeral server's database)

    def env(self, ephemeral_prefect: bool = False, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_ADDRESS", "AWS_",
                                                                          "SPILLOVER_"))}
        env.update(PREFECT_HOME=str(self.prefect_home), SPILLOVER_TEST_HOOKS="kill_hook",
                   PYTHONPATH=os.pathsep.join([str(TESTS / "e2e"), str(TESTS),
                                               env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if not ephemeral_prefect:
            env["PREFECT_API_URL"] = self.api_url
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, args: list[str], timeout_s: float = 600, ephemeral_prefect: bool = False, nice: bool | None = None,
            **env_extra) -> Run:
        run = Run(args, self.tmp_path / f"spillover-{next(self.count)}-{args[0]}.log")
        self.runs.append(run)
        with open(run.log, "wb") as out:
            proc = start_background([str(BIN / "spillover"), *args], lower=self.nice if nice is None else nice,
                                    cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(ephemeral_prefect, **env_extra))
        run.session = proc.pid

        def ended() -> int | None:  # record the session's processes while it is alive (it may kill itself)
            run.seen.update(session_processes(run.session))
            return proc.poll()

        try:
            wait_for(ended, timeout_s, f"`spillover {args[0]}` exits", every=0.5, until=lambda code: code is not None)
        except WaitTimedOut:
            proc.kill()
            proc.wait()
            run.ended = time.monotonic()
            raise TimeoutError(f"{args} ran over {timeout_s} s:\n{self.output(run)}") from None
        run.returncode, run.ended = proc.returncode, time.monotonic()
        return run

    @staticmethod
    def output(run: Run) -> str:
        return run.log.read_text(errors="replace")[-4000:]

    def check_gone(self, run: Run, grace_s: float = LEFTOVER_GRACE_S, ignore: tuple[str, ...] = ()) -> None:
        """Every process of the run's session is gone within grace_s of its end (those matching `ignore`
        aside)."""
        left = wait_until_gone([run.session], max(0.0, run.ended + grace_s - time.monotonic()), ignore)
        assert left == [], f"`spillover {run.args[0]}` left processes behind {grace_s:.0f} s after it ended: {left}"

    def reap(self) -> list[tuple[int, str]]:
        return reap([run.session for run in self.runs])


@pytest.fixture(scope="session")
def watch_until_gone():
    """watch(run): wait in the background until AGENT_GRACE_S after the run's end for every process of its
    session to be gone, then SIGKILL what is left; the session's end reports it. Ray's agents of a killed run
    take ~60 s to exit: the suite goes on meanwhile instead of waiting for them."""
    threads, leftovers = [], []

    def check(run: Run) -> None:
        left = wait_until_gone([run.session], max(0.0, run.ended + AGENT_GRACE_S - time.monotonic()))
        if left:
            leftovers.append((run.args[0], left))
            reap([run.session])

    def watch(run: Run) -> None:
        threads.append(threading.Thread(target=check, args=(run,), daemon=True))
        threads[-1].start()

    yield watch
    for thread in threads:
        thread.join()
    assert leftovers == [], f"processes still alive {AGENT_GRACE_S:.0f} s after their run ended: {leftovers}"


@pytest.fixture
def spillover(prefect_harness, watch_until_gone, tmp_path):
    runner = Spillover(prefect_harness.api_url, tmp_path)
    yield runner
    for run in runner.runs:
        watch_until_gone(run)


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_joined_runs_left_nothing(list_actors: Callable[[], list[dict]], grace_s: float = LEFTOVER_GRACE_S) -> None:
    """Every actor the joined runs created is dead and its worker process gone within grace_s: Ray ends a driver's job
    when the driver dies (SIGKILL included) and kills the job's actors. list_actors: those runs' actors and no others
    (e.g. `lambda: background.actors_of(pids)`): other tests' runs in the same cluster may still be running."""
    seen = list_actors()
    assert seen, "no run joined the Ray cluster"

    def alive() -> list[tuple[str, str, int]]:
        return [(a["ActorClassName"], a["State"], a["Pid"]) for a in list_actors()
                if a["State"] != "DEAD" or (a["Pid"] > 0 and psutil.pid_exists(a["Pid"]))]

    wait_for(alive, grace_s, "the actors of ended runs dead, their workers gone", every=0.5, until=lambda left: not left)
