"""Session fixture: a real S3 server (SeaweedFS `weed mini`) on 127.0.0.1 with free ports, a temporary data
dir, an s3.json identity with random keys and one bucket; stopped with SIGTERM, then SIGKILL, even when
tests fail. `storage_target` runs a test once against file:// and once against that server. Tests that kill or pause
a server (outages) get `outage_s3_server`, a second one: background runs (tests/background.py) use the first while the
other tests run."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

import pytest

from spillover.infra.config.run_config import StorageConfig
from spillover.bench.seaweed_server import SeaweedS3


def _running_server(directory):
    server = SeaweedS3(directory, bucket="spillover-test")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    yield from _running_server(tmp_path_factory.mktemp("seaweed"))


@pytest.fixture(scope="session")
def outage_s3_server(tmp_path_factory):
    yield from _running_server(tmp_path_factory.mktemp("seaweed-outages"))


@dataclass
class StorageTarget:
    kind: str                  # "file" or "s3"
    url: str                   # a fresh, empty location for this test
    cfg: StorageConfig
    server: SeaweedS3 | None   # the S3 server for kind == "s3"


@pytest.fixture(params=["file", "s3"])
def storage_target(request, tmp_path) -> StorageTarget:
    if request.param == "file":
        return StorageTarget("file", f"file://{tmp_path}/store", StorageConfig(), None)
    server = request.getfixturevalue("s3_server")
    prefix = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60] + "-" + uuid.uuid4().hex[:8]
    return StorageTarget("s3", server.url(prefix), server.storage_config(), server)
