"""RolloutManager's background health monitor: a task on the manager's loop that awaits the shared health
check every interval_s (which restarts dead or hung engines)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class HealthMonitor:
    """`check()` every interval_s while started; start/stop run on the loop's own thread."""

    def __init__(self, check: Callable[[], Awaitable[None]]):
        self.check = check
        self.task: asyncio.Task | None = None

    def start(self, interval_s: float) -> None:
        self.stop()
        self.task = asyncio.create_task(self._run(interval_s))

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def async_start(self, interval_s: float) -> None:
        """start() as a coroutine, for LoopThread.call from another thread."""
        self.start(interval_s)

    async def async_stop(self) -> None:
        self.stop()

    async def _run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.check()
