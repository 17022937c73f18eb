"""Session fixture for the rollout manager: two torch engines (the 'varied' tiny model) as Ray actors,
behind the real sglang-router that the manager starts, all on 127.0.0.1.

Tests that change it put it back: weights are restored to the checkpoint (version 0) and a killed engine
is restarted by the manager itself. The background health monitor is off here (tests that want it start it),
so that a test decides which check finds a broken engine.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rollout_manager(ray_session, varied_model_dir):
    from spillover.infra.config.engines import EnginesConfig
    from spillover.rollout.fleet.manager import RolloutManager

    cfg = EnginesConfig(rollout_num_gpus=2, gpus_per_engine=1, max_running_requests=32, health_timeout_s=3.0,
                        health_interval_s=0)
    manager = RolloutManager(cfg, varied_model_dir, use_gpu=False)
    try:
        yield manager
    finally:
        manager.shutdown()
