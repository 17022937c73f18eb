"""ref logprob and old logprob of the scored batch, computed in the learner actors (results stay in Ray)."""
from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NONE

from .learner.group import LearnerGroup
from .results import Logprobs, Scored


def needs_old_logprob_pass(token_versions: tuple[int, int], current_version: int, skip_old_logprob: bool) -> bool:
    """False when every token came from the current weights (oldest == newest == current) and the rollout
    logprobs may stand in for old logprobs. The one place this is decided: the learner takes what it is given."""
    if not skip_old_logprob:
        return True
    return tuple(token_versions) != (current_version, current_version)


@task(name="compute_ref_logprob", retries=1, cache_policy=NONE)
def compute_ref_logprob(policy: LearnerGroup, ref_group: LearnerGroup | None, scored: Scored,
                        kl_coef: float) -> Logprobs:
    """The KL reference's logprobs (grpo.kl_coef > 0): from its own group (learner.reference_placement=separate), or
    from the frozen copy the policy's ranks hold."""
    if kl_coef <= 0:
        return Logprobs(source="skipped (grpo.kl_coef = 0)")
    start = time.perf_counter()
    if ref_group is not None:
        ref = ref_group.compute_logprobs.remote(scored.batch_ref)
    else:
        ref = policy.compute_ref_logprobs.remote(scored.batch_ref)
    ray.get(ref)  # a failed pass raises here, in its own task (and its retry), not later in update
    return Logprobs(metrics={"ref_logprob_s": time.perf_counter() - start}, ref=ref, source="computed")


@task(name="compute_old_logprob", retries=1, cache_policy=NONE)
def compute_old_logprob(policy: LearnerGroup, scored: Scored, weight_version: int, skip_old_logprob: bool) -> Logprobs:
    if not needs_old_logprob_pass(scored.token_versions, weight_version, skip_old_logprob):
        return Logprobs(source="rollout")
    start = time.perf_counter()
    old = policy.compute_logprobs.remote(scored.batch_ref)
    ray.get(old)  # as above; the time is the pass's (plus fetching float32 per token)
    return Logprobs(metrics={"old_logprob_s": time.perf_counter() - start}, ref=old, source="computed")
