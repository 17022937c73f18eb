"""Length-aware dispatch through the real manager: rows the driver pinned to an engine (GenerateJob.engine) go to
that engine's URL, not through the sglang-router, and come back in input order; the rest still use the router.
Real Ray actors, real torch engines over HTTP, the real router (the shared `rollout_manager`)."""
from __future__ import annotations

import numpy as np

from spillover.rollout.drivers.dispatch import DispatchPlanner
from spillover.rollout.drivers.requests import SamplingSettings, build_requests

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 3], [40, 2, 2, 11, 30, 31, 12], [17], [33, 34, 35, 36], [9, 8, 7]]


def test_pinned_rows_go_to_their_engine_and_the_rest_through_the_router(rollout_manager):
    m = rollout_manager
    assert m.num_engines == 2
    pinned_router = m._gen.router
    sent: list[str] = []
    through_router: list[str] = []
    real_client_for, real_router_generate = pinned_router.client_for, pinned_router.router.generate

    def recording_client_for(url):
        sent.append(url)
        return real_client_for(url)

    async def recording_router_generate(request):
        through_router.append(request.rid)
        return await real_router_generate(request)

    pinned_router.client_for, pinned_router.router.generate = recording_client_for, recording_router_generate
    try:
        requests = build_requests(PROMPTS, np.full(len(PROMPTS), 6), SamplingSettings(temperature=0.0))
        engines = np.array([1, 1, 0, 1])  # the last two rows carry no engine: the router's
        jobs = DispatchPlanner.route(requests[:4], engines) + DispatchPlanner.route(requests[4:], None)
        answers = m.generate(jobs)
    finally:
        pinned_router.client_for, pinned_router.router.generate = real_client_for, real_router_generate
    assert sorted(sent) == sorted([m.urls[1]] * 3 + [m.urls[0]])
    assert sorted(through_router) == sorted(r.rid for r in requests[4:])
    assert [a.meta_info.id for a in answers] == [r.rid for r in requests]
    assert all(a.meta_info.finish_reason.type in ("stop", "length") for a in answers)
