"""Warm parts for in-process flow tests: the session keeps one set of engines and learner groups
(flows/parts.py), and each run of a test that asks for `warm_parts` borrows them, reset to a fresh start,
instead of starting Ray actors (seconds per actor on 2 cores). tests/integration/test_warm_parts.py checks
that a run on borrowed parts trains exactly as one on new parts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def warm_pool(ray_session):
    from spillover.flows.parts import WarmParts

    with WarmParts(max_idle=3) as pool:  # the suite's runs alternate between a few engine and learner shapes
        yield pool


@pytest.fixture
def warm_parts(warm_pool):
    """Runs started in this test (flows, `spillover` in process) borrow the session's engines and learners."""
    with warm_pool.active():
        yield warm_pool
