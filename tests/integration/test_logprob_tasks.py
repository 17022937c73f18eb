"""The logprob tasks (tasks/logprob.py) on a real Ray actor: a pass that fails raises in its own task, so the task's
retry runs it again (before, ray.wait returned the failed ref and the error surfaced later, in update, with no
retry). The actor stands in for the learner group: only its compute_logprobs is called."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def test_a_failed_old_logprob_pass_is_retried_in_its_own_task(prefect_harness, ray_session):
    ray = ray_session
    from spillover.tasks.logprob import compute_old_logprob

    @ray.remote
    class FailsOnce:
        def __init__(self):
            self.calls = 0

        def compute_logprobs(self, batch):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("a transient failure")
            return np.full(batch, -1.0, dtype=np.float32)

        def count(self):
            return self.calls

    policy = FailsOnce.remote()
    scored = SimpleNamespace(token_versions=(0, 1), batch_ref=3)  # stale tokens: the pass is needed
    from prefect import flow

    @flow
    def one_task():  # as in an iteration's flow run
        return compute_old_logprob(policy, scored, weight_version=1, skip_old_logprob=True)

    out = one_task()
    assert out.source == "computed" and ray.get(policy.count.remote()) == 2
    np.testing.assert_array_equal(ray.get(out.ref), np.full(3, -1.0, dtype=np.float32))
