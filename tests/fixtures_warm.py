"""Warm parts for in-process flow tests: the session keeps one set of engines and learner groups
(tests/warm_parts.py), and a test that asks for `warm_parts` lends them to the runs it starts
(`grpo_train(cfg, parts=warm_parts)`, `main(argv, parts=warm_parts)`), reset to a fresh start, instead of starting
Ray actors (seconds per actor on 2 cores). tests/integration/test_warm_parts.py checks that a run on borrowed parts
trains exactly as one on new parts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def warm_pool(ray_session):
    from warm_parts import WarmParts

    with WarmParts(max_idle=3) as pool:  # the suite's runs alternate between a few engine and learner shapes
        yield pool


@pytest.fixture
def warm_parts(warm_pool):
    """The session's engines and learners, for the runs this test starts (passed to each as `parts`)."""
    return warm_pool
