"""update: one GRPO step in the policy actor, then the new weights go to every engine.

Never retried: a half-applied update must not be applied twice.
"""
from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NONE

LOGGED = ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm", "tis_weight_mean", "tis_weight_max",
          "stale_token_share", "entropy", "old_logprob_source", "weight_version", "update_s", "lr",
          "optimizer_steps", "token_staleness_max", "version_span_max", "is_weight_p50", "is_weight_p90",
          "is_weight_p99", "is_weight_max", "masked_token_share", "rejected_sequence_share", "logprob_mismatch_kl",
          "is_weight_hist")


@task(name="update", retries=0, cache_policy=NONE)
def update(run) -> dict:
    it = run.current
    metrics = ray.get(run.policy.update.remote(it.train_batch_ref, it.old_logprobs, it.ref_logprobs))
    run.weight_version = int(metrics["weight_version"])
    if not run.cfg.schedule.debug_rollout_only and run.engine is not None:
        start = time.perf_counter()
        run.engine.update_weights(run.policy.state_dict_ref.remote(), run.weight_version)
        it.metrics["weight_sync_s"] = time.perf_counter() - start
    metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
    it.metrics.update({k: metrics[k] for k in LOGGED if k in metrics})
    return metrics
