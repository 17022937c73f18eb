"""generate-until-ready: the iteration's samples from the rollout controller (by default partial
rollout over the dock until >= GBS groups are ready; or a custom/SFT function, or replayed debug data)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE


@task(name="generate_until_ready", cache_policy=NONE)
def generate_until_ready(run, iteration: int, on_round=None) -> dict:
    run.on_round = on_round
    groups = run.controller.generate(iteration, run)
    run.current.samples = groups
    metrics = {"groups": len(groups), "samples": sum(len(g) for g in groups)}
    for key in ("rounds", "requests", "tokens_generated", "generate_time_s", "engine_s", "ready_groups"):
        if key in run.current.metrics:
            metrics[key] = run.current.metrics[key]
    return metrics
