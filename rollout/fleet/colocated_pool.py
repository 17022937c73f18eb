"""Engines hosted by the policy learner's ranks (placement.colocate; tasks/learner/engine_host.py): engine i lives in rank
i's process, on its node and devices, so a colocated run starts no engine actors and no placement group of its
own (the ranks' bundles hold the devices).

`ColocatedEnginePool` keeps EnginePool's interface (the manager starts, restarts, kills and shuts engines down
the same way); an engine's "actor" is a `HostedEngine`, which forwards EngineActor calls to its rank. Killing a
hosted engine stops its server and leaves the rank alone; a rank that dies takes its engine (and an SGLang server,
fate-shared with it) along, and the run fails as it does when any learner rank dies.
"""
from __future__ import annotations

from typing import Any

import ray

from ...infra.config.placement import check_colocated_engines
from .engine_pool import EngineHandle, EnginePool


class _HostedMethod:
    def __init__(self, host: Any, name: str):
        self.host, self.name = host, name

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.host.engine_call.remote(self.name, *args, **kwargs)


class HostedEngine:
    """Looks like an EngineActor handle: `.start.remote(...)` runs EngineActor.start in the hosting rank."""

    def __init__(self, host: Any):
        self.host = host

    def __getattr__(self, name: str) -> _HostedMethod:
        if name.startswith("_") or name == "host":
            raise AttributeError(name)
        return _HostedMethod(self.host, name)


class ColocatedEnginePool(EnginePool):
    def __init__(self, cfg, model_path: str, *, hosts: list[Any], **options: Any):
        check_colocated_engines(cfg, len(hosts))
        self.hosts = list(hosts)
        options.update(slots_per_node=1, torch_threads=None)  # the rank's torch threads are the learner's
        super().__init__(cfg, model_path, **options)

    def _reserve(self, strategy: str) -> None:
        return None

    def _locate_bundles(self) -> list[tuple[str, list[int]]]:
        nodes = ray.get([host.node_id.remote() for host in self.hosts])
        return [(node, [0] if self.use_gpu else []) for node in nodes]  # GPU 0: the rank's own (CUDA_VISIBLE_DEVICES)

    def new_actors(self, index: int) -> tuple[list[Any], list[int]]:
        host = self.hosts[index]
        host.host_engine.remote(self.cfg.backend, self.model_path, index, tp_size=1, seed=self.seed + index,
                                weight_version=self.weight_version, **self.actor_kwargs)  # runs before later calls
        return [HostedEngine(host)], [index]

    async def start_engine(self, index: int) -> EngineHandle:
        actors, bundles = self.new_actors(index)
        try:
            return await self._start_actors(index, actors, bundles)
        except BaseException:
            self.hosts[index].drop_engine.remote()
            raise

    def kill_engine(self, index: int, graceful: bool = True) -> None:
        handle = self.engines[index]
        try:
            ray.get(self.hosts[index].drop_engine.remote(), timeout=20 if graceful else 5)
        except Exception:  # the rank is dead or hung: its engine went or goes with it
            pass
        handle.url = None

    def shutdown(self) -> None:
        for index in range(len(self.engines)):
            self.kill_engine(index)
