"""grpo.reward_timeout_s (rollout/scoring/rule_reward.py score_responses): a reward call that does not return in time
fails the scoring with one error naming the sample and the setting, for plain and `async def` functions alike; without
the setting, or in time, the rewards are as before."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from spillover.rollout.scoring.rule_reward import RewardError, score_responses

RELEASE = threading.Event()  # set at the end so the hung call's daemon thread ends too


def hangs_on_b(response, label):
    if response == "b":
        RELEASE.wait(30)
    return float(len(response))


async def hangs_on_b_async(response, label):
    if response == "b":
        await asyncio.sleep(30)
    return float(len(response))


def describe(i: int) -> str:
    return f"sample {i}"


@pytest.mark.parametrize("fn", [hangs_on_b, hangs_on_b_async], ids=["plain", "async"])
def test_a_call_past_the_limit_names_its_sample_and_the_setting(fn):
    try:
        tic = time.monotonic()
        with pytest.raises(RewardError, match=r"did not return within grpo.reward_timeout_s=0.2 s on sample 1"):
            score_responses(["aa", "b", "ccc"], [0, 0, 0], fn, "tests.hangs_on_b", describe, timeout_s=0.2)
        assert time.monotonic() - tic < 5
    finally:
        RELEASE.set()
    RELEASE.clear()


def test_calls_in_time_score_as_without_a_limit_and_errors_still_name_the_sample():
    quick = lambda response, label: float(len(response) + label)
    plain = score_responses(["aa", "ccc"], [1, 2], quick, "tests.quick", describe)
    np.testing.assert_array_equal(score_responses(["aa", "ccc"], [1, 2], quick, "tests.quick", describe, timeout_s=5),
                                  plain)

    def raises(response, label):
        raise KeyError("no label")

    with pytest.raises(RewardError, match=r"raised on sample 0: KeyError"):
        score_responses(["aa"], [1], raises, "tests.raises", describe, timeout_s=5)
