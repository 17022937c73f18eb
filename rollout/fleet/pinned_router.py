"""Per-engine dispatch for length-aware scheduling: a GenerateJob with an `engine` goes straight to that engine, the
rest through the sglang-router.

The router balances by request count (round_robin) or cache affinity; it cannot know how long a response
will be. With rollout.scheduling = length_aware the drivers pin each row to an engine (rollout.scheduling's
balance_engines: each engine's expected remaining tokens level, a group's rows spread), and the manager's
BatchGenerator asks this object for the client of each attempt. The engine's URL is looked up at that moment: a
restarted engine (new URL) still gets its rows, and a retried request goes to the same engine.
"""
from __future__ import annotations

from collections.abc import Callable

from .engine_client import EngineClient


class PinnedRouter:
    def __init__(self, router: EngineClient, engine_url: Callable[[int], str | None],
                 client_for: Callable[[str], EngineClient]):
        """router: the sglang-router's client; engine_url(i): engine i's node-0 URL now (None: gone);
        client_for(url): the manager's client for that engine."""
        self.router, self.engine_url, self.client_for = router, engine_url, client_for

    def client(self, engine: int | None) -> EngineClient:
        """The client for a job pinned to `engine` (None, or an engine gone: the router's)."""
        url = self.engine_url(engine) if engine is not None else None
        return self.client_for(url) if url else self.router

    async def aclose(self) -> None:
        await self.router.aclose()
