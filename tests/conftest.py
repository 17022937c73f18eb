"""Session-wide services for the suite: the tiny model, Ray on loopback, and (via the plugins
listed below) the sglang router, CPU engines, the S3 server and Prefect. Each is started once on
127.0.0.1 and stopped even when a test fails."""
from __future__ import annotations

import os

import pytest

# Ray reads this once, when it is imported (spillover.infra.cluster imports it): set it first, or the driver, the
# actors and the engines they start take the host's address and Ray listens on every interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from spillover.infra.cluster import set_loopback_env  # noqa: E402
from spillover.infra.prefect.env import apply_process_defaults

set_loopback_env()
apply_process_defaults()

# Fixture modules of each area; add yours here.
pytest_plugins: list[str] = ["fixtures_engines", "fixtures_s3", "fixtures_manager", "fixtures_prefect",
                               "fixtures_warm", "background", "spillover_runs",
                               "fixtures_early",
                               "pytester"]  # tests/ is on sys.path (rootdir conftest); pytester: test_run_order.py


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from spillover.infra.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from spillover.infra.cluster import init_ray

    # A SIGSTOPped (hung) actor that ray.kill cannot stop gracefully is SIGKILLed after this (Ray's default: 5 s).
    # Given to this Ray instance only: an environment variable would reach every `spillover` process tests start.
    init_ray(num_cpus=8, system_config={"kill_worker_timeout_milliseconds": 500})
    yield ray
    ray.shutdown()
