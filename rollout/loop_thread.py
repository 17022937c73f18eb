"""An asyncio event loop running in its own daemon thread, callable from sync code and from other loops."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def call(self, coro: Coroutine) -> Any:
        """Run coro on the loop and block until it finishes (not from the loop's own thread: that deadlocks)."""
        if self.on_loop_thread():
            coro.close()
            raise RuntimeError(f"a blocking call was made on {self.thread.name}'s own loop (from a callback?): "
                               "use the async_ variant")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run(self, coro: Coroutine) -> Any:
        """Await coro on this loop from any running loop (this one included)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def schedule(self, coro: Coroutine):
        """Start coro on the loop without waiting for it; -> its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()
