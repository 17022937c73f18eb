"""ref logprob and old logprob of the chosen batch, computed in the learner actors (results stay in Ray)."""
from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NONE


def needs_old_logprob_pass(weight_versions: list[list[int]], current_version: int, skip_old_logprob: bool) -> bool:
    """False when every token came from the current weights and rollout logprobs may stand in."""
    if not skip_old_logprob:
        return True
    return any(v != current_version for vs in weight_versions for v in vs)


@task(name="compute_ref_logprob", retries=1, cache_policy=NONE)
def compute_ref_logprob(run) -> dict:
    it = run.current
    if run.ref is None:
        return {"ref_logprob": "skipped (grpo.kl_coef = 0)"}
    start = time.perf_counter()
    it.ref_logprobs = run.ref.compute_logprobs.remote(it.train_batch_ref)
    ray.wait([it.ref_logprobs])
    it.metrics["ref_logprob_s"] = time.perf_counter() - start
    return {"ref_logprob": "computed"}


@task(name="compute_old_logprob", retries=1, cache_policy=NONE)
def compute_old_logprob(run) -> dict:
    it = run.current
    if not needs_old_logprob_pass(it.train_batch.weight_versions, run.weight_version, run.cfg.grpo.skip_old_logprob):
        it.old_logprobs = None
        return {"old_logprob": "rollout logprobs (all tokens from current weights)"}
    start = time.perf_counter()
    it.old_logprobs = run.policy.compute_logprobs.remote(it.train_batch_ref)
    ray.wait([it.old_logprobs])  # compute time, reported apart from Prefect/Ray overhead
    it.metrics["old_logprob_s"] = time.perf_counter() - start
    return {"old_logprob": "computed"}
