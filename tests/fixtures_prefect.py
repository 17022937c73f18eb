"""Session fixture: one Prefect API server (prefect_test_harness) for every test that needs Prefect, in
process (flows called from tests) or as subprocesses (`spillover` with PREFECT_API_URL). A server start
costs ~10-25 s on 2 cores; one per module cost minutes.

Everything the tests check in it is scoped by a flow-run name or id, so sharing it is safe.

Flow runs in the test process send no heartbeats: Prefect's heartbeat thread sleeps in 1 s steps and every flow run
joins it at its end, idle 0-1 s per run (py-spy: ~0.9 s of a refused run's 1.2 s), and the suite runs hundreds of
short flows. No test is about heartbeats; `spillover` subprocesses and users keep Prefect's default."""
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import NamedTuple

import pytest


class PrefectServer(NamedTuple):
    api_url: str
    database: Path | None  # its SQLite file (the harness's temporary directory)


@pytest.fixture(scope="session")
def prefect_harness() -> PrefectServer:
    from prefect.settings import (PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL,
                                  PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        db = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
        yield PrefectServer(PREFECT_API_URL.value(), Path(db.split(":///", 1)[-1]) if ":///" in db else None)


def copy_migrated_database(source: Path, prefect_home: Path) -> None:
    """A consistent copy (SQLite's backup API; the source server keeps running) of a database this Prefect version
    has migrated, where `prefect server start` looks for its own (PREFECT_HOME/prefect.db)."""
    prefect_home.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(prefect_home / "prefect.db")) as dst:
        src.backup(dst)
