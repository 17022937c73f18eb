"""Per-engine dispatch for length-aware scheduling: requests that carry "engine_index" go straight to that
engine, the rest through the sglang-router.

The router balances by request count (round_robin) or cache affinity; it cannot know how long a response
will be. With rollout.scheduling = length_aware the drivers pin each row to an engine (rollout.scheduling's
balance_engines: each engine's expected remaining tokens level, a group's rows spread), and the manager's
BatchGenerator posts through this object instead of the router client. The pin is looked up by the request
id when the request is sent, and the engine's URL at that moment: a restarted engine (new URL) still gets
its rows, and a retried request goes to the same engine.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .engine_client import EngineClient


class PinnedRouter:
    def __init__(self, router: EngineClient, engine_url: Callable[[int], str | None],
                 client_for: Callable[[str], EngineClient]):
        """router: the sglang-router's client; engine_url(i): engine i's node-0 URL now (None: gone);
        client_for(url): the manager's client for that engine."""
        self.router, self.engine_url, self.client_for = router, engine_url, client_for
        self.pins: dict[str, int] = {}

    @property
    def url(self) -> str:
        return self.router.url

    def pin(self, batch: list[dict]) -> list[str]:
        """Record the engine of every item with an "engine_index" (it must carry its "rid"); -> the rids pinned."""
        pinned = []
        for item in batch:
            engine = item.get("engine_index")
            if engine is None:
                continue
            if not item.get("rid"):
                raise ValueError("a request with an engine_index needs its own 'rid' (build_requests gives one)")
            self.pins[item["rid"]] = int(engine)
            pinned.append(item["rid"])
        return pinned

    async def run(self, generate_round: Callable[..., Awaitable[list[dict]]], batch: list[dict], on_result=None):
        """generate_round(batch, on_result) with the batch's pins in force; they go when it returns."""
        rids = self.pin(batch)
        try:
            return await generate_round(batch, on_result)
        finally:
            for rid in rids:
                self.pins.pop(rid, None)

    async def post(self, path: str, **kwargs: Any):
        body = kwargs.get("json") or {}
        engine = self.pins.get(body.get("rid")) if path == "/generate" else None
        url = self.engine_url(engine) if engine is not None else None
        return await (self.client_for(url) if url else self.router).post(path, **kwargs)

    async def aclose(self) -> None:
        await self.router.aclose()
