"""generate-until-ready: the iteration's batch from the rollout controller (by default partial rollout over
the dock until >= GBS groups are ready; or a custom/SFT function, or replayed debug data)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from spillover.rollout.context import RolloutContext
from spillover.rollout.controller import RolloutController
from spillover.tasks.results import Rollout


@task(name="generate_until_ready", cache_policy=NONE)
def generate_until_ready(controller: RolloutController, context: RolloutContext, iteration: int) -> Rollout:
    """controller: spillover.rollout.controller.RolloutController; context: spillover.rollout.context.RolloutContext."""
    overlap = context.detached is not None  # rollout.overlap: requests may have run through the last update
    cut_before = context.engine.overlap_stats()["tokens_cut_by_updates"] if overlap else 0
    out = controller.generate(iteration, context)
    if getattr(context.engine, "colocated", False):  # the learner's turn with the device (update resumes them)
        context.engine.offload()
    batch = out.batch
    metrics = {"groups": len(batch.group_ids), "samples": len(batch), **out.stats}
    if overlap:  # tokens of requests the last update's pause ended (engines.pause_mode=abort; kept, continued here)
        metrics["tokens_cut_by_updates"] = context.engine.overlap_stats()["tokens_cut_by_updates"] - cut_before
    return Rollout(metrics=metrics, batch=batch, from_dock=controller.uses_dock)
