"""A stand-in engine client for tests of the real fleet's request loop (rollout/fleet/generation.py BatchGenerator)
where no SGLang runs: it answers every request with no tokens, at once or (gated) once the test opens that request's
gate, and records the rids that reached it."""
from __future__ import annotations

import asyncio

from spillover.rollout.fleet.generation import BatchGenerator
from spillover.rollout.sglang.protocol import GenerateResponse


class StandInClient:
    def __init__(self, gated: bool = False):
        self.sent: list[str] = []
        self.gated = gated
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    def open_all(self) -> None:
        """Every request answers from now on, the waiting ones too."""
        self.gated = False
        for gate in self.gates.values():
            gate.set()

    async def generate(self, request):
        self.sent.append(request.rid)
        if self.gated:
            await self.gate(request.rid).wait()
        else:
            await asyncio.sleep(0)
        return GenerateResponse.never_sent(request, "stand-in answer")


class _OneClientRouter:
    def __init__(self, client):
        self._client = client

    def client(self, engine):
        return self._client


async def _no_recovery(*_):
    raise AssertionError("no recovery expected")


def stand_in_generator(client: StandInClient, max_in_flight: int = 256) -> BatchGenerator:
    """The real BatchGenerator with every request going to `client` (no engine URLs: abort_all has none to abort)."""
    return BatchGenerator(_OneClientRouter(client), lambda: [], lambda url: client, _no_recovery,
                          max_in_flight=max_in_flight)
