"""Session fixture: one Prefect API server (prefect_test_harness) for every test that needs Prefect, in
process (flows called from tests) or as subprocesses (`spillover` with PREFECT_API_URL). A server start
costs ~10-25 s on 2 cores; one per module cost minutes.

Everything the tests check in it is scoped by a flow-run name or id, so sharing it is safe."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest


class PrefectServer(NamedTuple):
    api_url: str
    database: Path | None  # its SQLite file (the harness's temporary directory)


@pytest.fixture(scope="session")
def prefect_harness() -> PrefectServer:
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        db = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
        yield PrefectServer(PREFECT_API_URL.value(), Path(db.split(":///", 1)[-1]) if ":///" in db else None)
