"""update: the GRPO steps in the policy actor, then the new weights go to every engine.

Never retried: a half-applied update must not be applied twice.
"""
from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NONE

from ..rollout.contracts.fleet import Fleet
from .learner.group import LearnerGroup
from .results import Logprobs, Scored, Updated

LOGGED = ("loss", "pg_loss", "kl", "kl_coef", "clip_fraction", "grad_norm", "tis_weight_mean", "tis_weight_max",
          "stale_token_share", "entropy", "old_logprob_source", "weight_version", "update_s", "lr",
          "optimizer_steps", "nll", "token_staleness_max", "version_span_max", "is_weight_p50", "is_weight_p90",
          "is_weight_p99", "is_weight_max", "masked_token_share", "rejected_sequence_share", "logprob_mismatch_kl",
          "is_weight_hist", "padding_share")


@task(name="update", retries=0, cache_policy=NONE)
def update(policy: LearnerGroup, fleet: Fleet | None, scored: Scored, old: Logprobs, ref: Logprobs) -> Updated:
    """fleet: the engines to send the new weights to (None: no engines, e.g. replayed data)."""
    metrics = ray.get(policy.update.remote(scored.batch_ref, old.ref, ref.ref))
    version = int(metrics["weight_version"])
    out = {k: metrics[k] for k in LOGGED if k in metrics}
    out["old_logprob_source"] = old.source  # "computed" by the learner, or "rollout" logprobs
    if fleet is not None:
        start, overlapped = time.perf_counter(), fleet.overlap_stats()["updates_while_generating"]
        fleet.load_policy_weights(policy, version)
        out["weight_sync_s"] = time.perf_counter() - start
        # rollout.overlap: 1 when requests generated through this update (paused and continued, not aborted)
        out["update_while_generating"] = fleet.overlap_stats()["updates_while_generating"] - overlapped
        if fleet.colocated:  # what the hosting process did this iteration, in order
            out["colocation_events"] = fleet.take_colocation_log()
    return Updated(metrics=out, weight_version=version)
