"""The distributed sync waits for the engines' posts of a bucket unless the sender fails first
(rollout/fleet/weights/fleet_weights.py): a failed sender ends the wait at once instead of after weight_sync_timeout_s.
The real path (a learner group whose broadcast fails while two engines wait in their receive) is in
tests/integration/test_weight_sync.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from spillover.rollout.fleet.weights.fleet_weights import _unless_sender_fails


async def after(seconds: float, value=None, error: Exception | None = None):
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return value


def test_a_failed_sender_ends_the_wait_and_cancels_the_posts():
    async def scenario():
        posts = asyncio.ensure_future(after(30, "never"))
        sending = asyncio.ensure_future(after(0.01, error=RuntimeError("sender died")))
        tic = time.monotonic()
        with pytest.raises(RuntimeError, match="sender died"):
            await _unless_sender_fails(posts, sending)
        await asyncio.sleep(0)
        return time.monotonic() - tic, posts.cancelled()

    waited, cancelled = asyncio.run(scenario())
    assert waited < 5 and cancelled


def test_posts_are_awaited_when_the_sender_is_done_first_or_still_sending():
    async def scenario(sender_s: float):
        sending = asyncio.ensure_future(after(sender_s, {"bytes": 1}))
        got = await _unless_sender_fails(after(0.05, ["ok", "ok"]), sending)
        return got, await sending

    assert asyncio.run(scenario(0.0)) == (["ok", "ok"], {"bytes": 1})
    assert asyncio.run(scenario(0.2)) == (["ok", "ok"], {"bytes": 1})


def test_a_failed_post_is_raised_while_the_sender_still_runs():
    async def scenario():
        sending = asyncio.ensure_future(after(30))
        try:
            await _unless_sender_fails(after(0.01, error=ConnectionError("engine gone")), sending)
        finally:
            sending.cancel()

    with pytest.raises(ConnectionError, match="engine gone"):
        asyncio.run(scenario())
