"""Torch engines in this process, without Ray or the router, for the GPU machine (it has neither): what the rollout
drivers and bench/longtail_real.py need from a RolloutManager (generate with on_result and round abort, num_engines,
urls, update_weights), on the same HTTP protocol and the same BatchGenerator and PinnedRouter as the manager. Requests go
to their pinned engine, else round robin. `python bench/longtail.py --real --local [--device cuda]` uses it, and
bench/gpu_smoke.py runs max_split 1 vs 4 through it."""
from __future__ import annotations

import asyncio
import itertools

from ..rollout.fleet.engine_client import EngineClient
from ..rollout.sglang.protocol import GenerateJob, GenerateRequest, GenerateResponse
from ..rollout.fleet.weights.weight_update import WeightUpdate
from ..rollout.torch_engine.server import TorchEngineServer
from ..rollout.fleet.generation import BatchGenerator
from ..rollout.fleet.pinned_router import PinnedRouter


class _RoundRobin:
    """Stands in for the sglang-router (not installed on the GPU machine): each request goes to the next engine."""

    def __init__(self, clients: list[EngineClient]):
        self.clients, self.turn = clients, itertools.cycle(clients)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        return await next(self.turn).generate(request)


class LocalEngines:
    def __init__(self, model_path: str, engines: int = 1, slots: int = 64, device: str | None = None,
                 max_model_len: int | None = None):
        self.model_path = str(model_path)
        self.servers = [TorchEngineServer(self.model_path, port=0, max_running_requests=slots, device=device, seed=i,
                                          max_model_len=max_model_len) for i in range(engines)]
        for server in self.servers:
            server.start()
        self.urls = [server.url for server in self.servers]

    @property
    def num_engines(self) -> int:
        return len(self.servers)

    def generate(self, batch: list[GenerateJob], on_result=None) -> list[GenerateResponse]:
        async def run() -> list[GenerateResponse]:
            clients = [EngineClient(url) for url in self.urls]
            by_url = dict(zip(self.urls, clients))

            async def no_recovery() -> None:
                return None

            router = PinnedRouter(_RoundRobin(clients), lambda i: self.urls[i % len(self.urls)], by_url.__getitem__)
            gen = BatchGenerator(router, lambda: self.urls, by_url.__getitem__, no_recovery,
                                 max_attempts=1, max_in_flight=sum(s.max_running_requests for s in self.servers))
            try:
                return await gen.generate_round(batch, on_result)
            finally:
                await asyncio.gather(*(c.aclose() for c in clients))

        return asyncio.run(run())

    def update_weights(self, update: WeightUpdate) -> None:
        """A disk update only (the GPU machine's checks load HF folders)."""
        if update.kind != "disk":
            raise ValueError(f"LocalEngines loads disk weight updates only; got {update.kind}")

        async def run() -> None:
            clients = [EngineClient(url) for url in self.urls]
            try:
                await asyncio.gather(*(c.update_weights_from_disk(update.source, update.version) for c in clients))
            finally:
                await asyncio.gather(*(c.aclose() for c in clients))

        asyncio.run(run())

    def shutdown(self) -> None:
        for server in self.servers:
            server.stop()
