"""generate-until-ready: run the engines over the dock until >= GBS groups are ready, then fix the batch."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from rollout.partial import SamplingSettings, generate_until_ready_sync
from rollout.partial_async import generate_until_ready_async


def generate_batch(dock, engine, rollout_cfg, stop_token_ids, weight_version: int, drain: bool,
                   on_round=None) -> dict:
    """Generate until the dock is ready, choose the training batch once, and return small stats."""
    sampling = SamplingSettings.from_rollout(rollout_cfg, stop_token_ids)
    driver = generate_until_ready_async if rollout_cfg.mode == "async" else generate_until_ready_sync
    stats = driver(dock, engine, rollout_cfg, sampling, weight_version, drain, on_round)
    dock.select_batch()
    return stats.as_dict()


@task(name="generate_until_ready", cache_policy=NONE)
def generate_until_ready(run, iteration: int, on_round=None) -> dict:
    drain = iteration == run.cfg.schedule.num_iterations - 1
    return generate_batch(run.dock, run.engine, run.cfg.rollout, run.stop_token_ids, run.weight_version,
                          drain, on_round)
