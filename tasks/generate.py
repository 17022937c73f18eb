"""generate-until-ready: the iteration's batch from the rollout controller (by default partial rollout over
the dock until >= GBS groups are ready; or a custom/SFT function, or replayed debug data)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from ..rollout.context import RolloutContext
from ..rollout.controller import RolloutController
from .results import Rollout


@task(name="generate_until_ready", cache_policy=NONE)
def generate_until_ready(controller: RolloutController, context: RolloutContext, iteration: int) -> Rollout:
    """controller: spillover.rollout.controller.RolloutController; context: spillover.rollout.context.RolloutContext."""
    overlap = context.detached is not None  # rollout.overlap: requests may have run through the last update
    before = context.fleet.overlap_stats() if overlap else {}
    out = controller.generate(iteration, context)
    if context.fleet is not None and context.fleet.colocated:  # the learner's turn with the device (update resumes them)
        context.fleet.offload()
    batch = out.batch
    metrics = {"groups": len(batch.group_ids), "samples": len(batch), **out.stats}
    if overlap:
        metrics.update(overlap_metrics(before, context.fleet.overlap_stats()))
    return Rollout(metrics=metrics, batch=batch, from_dock=controller.uses_dock)


def overlap_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What this generate step collected of the requests left running since the last one (RolloutManager.overlap_stats
    before and after): tokens_cut_by_updates (tokens of requests the update's pause ended, engines.pause_mode=abort;
    kept and continued) and overlap_generating_share (of the time from the last batch choice to this step, through
    reward, logprobs, the update and the checkpoint, the share in which requests still generated; 0 when none ran)."""
    span = after["detached_span_s"] - before["detached_span_s"]
    generating = after["detached_generating_s"] - before["detached_generating_s"]
    return {"tokens_cut_by_updates": int(after["tokens_cut_by_updates"] - before["tokens_cut_by_updates"]),
            "overlap_generating_share": round(generating / span, 4) if span > 0 else 0.0}
