"""RolloutManager's abort_all, callable from any thread and from on_result callbacks.

Callbacks run on the manager's own loop, where blocking would deadlock: abort_all called there is only
scheduled, and generate() settles every abort scheduled meanwhile before it returns. Left running, such an
abort would stop the next round and abort its requests on the engines.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

from rollout.generation import BatchGenerator
from rollout.loop_thread import LoopThread


class PendingAborts:
    """abort_all of `generator` on `loop`; `futures` holds the aborts scheduled from the loop's own thread."""

    def __init__(self, loop: LoopThread, generator: BatchGenerator):
        self.loop, self.generator = loop, generator
        self.futures: list[Future] = []

    def abort_all(self, timeout_s: float) -> None:
        """Stop every running round and abort every engine; blocks until they are idle (only schedules
        when called on the loop's own thread)."""
        self.generator.stop_rounds()
        if self.loop.on_loop_thread():
            self.futures.append(self.loop.schedule(self.generator.abort_all(timeout_s)))
        else:
            self.loop.call(self.generator.abort_all(timeout_s))

    async def async_abort_all(self, timeout_s: float) -> None:
        self.generator.stop_rounds()
        await self.loop.run(self.generator.abort_all(timeout_s))

    def take(self) -> list[Future]:
        pending, self.futures = self.futures, []
        return pending

    def settle(self) -> None:
        """Block until every abort scheduled so far has ended (re-raising its error)."""
        for future in self.take():
            future.result()

    async def async_settle(self) -> None:
        for future in self.take():
            await asyncio.wrap_future(future)
