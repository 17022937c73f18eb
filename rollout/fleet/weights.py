"""The weight side of RolloutManager: new weights to every engine (Ray's object store, an HF folder, or
SGLang's distributed broadcast group), and the latest weights to an engine that was restarted.

A mixin: it runs on the manager's event loop (`self._call`) under its engine lock, and uses its engines,
clients and restart logic.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import ray

from spillover.rollout.fleet.engine_pool import EngineHandle
from spillover.rollout.sglang import backend as sgl
from spillover.rollout.fleet.engine_client import EngineError
from spillover.rollout.fleet.distributed_weights import DistributedWeightSync, disk_folder, weight_sync_settings

log = logging.getLogger("spillover.rollout.fleet.manager")
Weights = dict | ray.ObjectRef | str | Path
ENGINE_GONE = (ray.exceptions.RayActorError, httpx.TransportError)


class EngineWeights:
    def update_weights(self, weights: Weights, weight_version: int | str) -> dict[int, Any]:
        """Load new weights on every engine: a state dict (put in Ray's object store once, shared), its
        ObjectRef, or an HF folder (update_weights_from_disk). Returns engine index -> reported version."""
        return self._call(self._update_weights, weights, weight_version)

    async def _update_weights(self, weights: Weights, weight_version: int | str) -> dict[int, Any]:
        if isinstance(weights, (str, Path)):
            latest = ("disk", str(weights), weight_version)
        elif isinstance(weights, ray.ObjectRef):
            latest = ("tensor", weights, weight_version)
        elif isinstance(weights, dict):
            latest = ("tensor", await asyncio.to_thread(ray.put, weights), weight_version)
        else:
            raise TypeError(f"update_weights takes a state dict, its ObjectRef or a checkpoint folder; "
                            f"got {type(weights).__name__}")
        async with self._engine_lock:
            self._latest_weights = latest  # what a restarted engine loads too
            outcomes = await asyncio.gather(*(self._apply_latest(h) for h in self.engines), return_exceptions=True)
            for handle, outcome in zip(self.engines, outcomes):
                if isinstance(outcome, ENGINE_GONE):  # a restarted engine loads the latest weights itself
                    log.warning("engine %d died during the weight update (%r): restarting it", handle.index, outcome)
                    await self._restart(handle.index)
            refused = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, ENGINE_GONE)]
            if refused:
                raise refused[0]
        return dict(self.weight_versions)

    def reset(self, model_path: str | Path, engines_cfg=None, seed: int | None = None) -> None:
        """Serve model_path's weights as version 0, as a newly started manager would (a run reusing these engines,
        flows/parts.py): leave the weight-update group, take memory back, load the folder on every engine, restart
        each torch engine's sampling generator from seed + its index (seed None: the pool's start seed; SGLang's
        seed is a launch flag: kept as is).
        engines_cfg: the new run's engines section (its weight-sync and health settings take effect; the
        settings the engines were started with must be the same: spillover.flows.parts.engine_key)."""
        self.stop_health_monitor()
        self._call(self._reset, str(model_path), engines_cfg or self.cfg, seed)
        if self.cfg.health_interval_s:
            self.start_health_monitor(self.cfg.health_interval_s)

    async def _reset(self, model_path: str, engines_cfg, seed: int | None) -> None:
        async with self._engine_lock:
            await self._weight_sync.leave(self._client)
            self.cfg = self.pool.cfg = engines_cfg
            self._weight_sync = DistributedWeightSync(**weight_sync_settings(engines_cfg, self.pool.use_gpu))
            if self._offloaded:
                payload = sgl.resume_memory_payload(None)
                await asyncio.gather(*(self._client(u).post(sgl.ENDPOINTS["resume_memory"], json=payload)
                                       for u in self.urls))
                self._offloaded = False
            self.model_path = self.pool.model_path = model_path  # what a restarted engine starts from
            self._latest_weights = ("disk", model_path, 0)
            await asyncio.gather(*(self._apply_latest(h) for h in self.engines))
            self._latest_weights, self.restarts = None, 0
            if self.cfg.backend == "torch":  # each engine's seed at start (EnginePool.new_actors): the stream anew
                if seed is not None:  # a restarted engine starts from it too
                    self.pool.seed = seed
                await asyncio.gather(*(h.actors[0].reseed.remote(self.pool.seed + h.index) for h in self.engines))

    def sync_weights(self, policy: Any, weight_version: int | str) -> dict[int, Any]:
        """The policy learner's current weights to every engine by engines.weight_sync: distributed (SGLang's
        broadcast group, bucket by bucket), tensor (Ray's object store) or disk (an HF folder the policy writes).
        Colocated engines are resumed first and loaded by the ranks that host them, bucket by bucket."""
        if self.colocated:
            return self._call(self._sync_colocated, policy, weight_version)
        mode = getattr(self.cfg, "weight_sync", "tensor")
        if mode == "distributed":
            return self._call(self._sync_distributed, policy, weight_version)
        return self.update_weights(policy.state_dict_ref.remote() if mode == "tensor" else ray.get(
            policy.save_weights.remote(disk_folder(self.cfg, self.model_path, weight_version))), weight_version)

    def sync_weights_distributed(self, policy: Any, weight_version: int | str) -> dict[int, Any]:
        return self._call(self._sync_distributed, policy, weight_version)

    async def _sync_distributed(self, policy: Any, weight_version: int | str) -> dict[int, Any]:
        async with self._engine_lock:
            self._latest_weights = ("distributed", policy, weight_version)  # a restarted engine rejoins for it
            try:
                await self._apply_latest(None)
            except (*ENGINE_GONE, EngineError):
                alive = await asyncio.gather(*(self._client(h.url).health() for h in self.engines))
                if all(alive):
                    raise
                for handle in [h for h, ok in zip(self.engines, alive) if not ok]:
                    await self._restart(handle.index)  # joins a new group and gets the current weights
                await self._apply_latest(None)  # the survivors that missed this version
        return dict(self.weight_versions)

    async def _sync_colocated(self, policy: Any, weight_version: int | str) -> dict[int, Any]:
        if self._offloaded:
            await self._memory(False, None, restore=False)  # the weights come next, from the learner
        async with self._engine_lock:
            self._latest_weights = ("colocated", policy, weight_version)
            await self._apply_latest(None)
        return dict(self.weight_versions)

    def take_colocation_log(self) -> list[str]:
        """What rank 0's process did since the last take, in order (tasks/learner/engine_host.py)."""
        return ray.get(self.hosts[0].take_colocation_log.remote())

    async def _restore_served_weights(self) -> None:
        """After a resume: released weights came back empty; load what the engines served (the latest weights, or
        the model folder at the version they report)."""
        latest = self._latest_weights
        if latest is None:
            await asyncio.gather(*(self._client(h.url).update_weights_from_disk(self.model_path,
                                                                              self.weight_versions[h.index])
                                   for h in self.engines))
        elif latest[0] in ("distributed", "colocated"):
            await self._apply_latest(None)  # every engine in one group (or every hosting rank) at once
        else:
            await asyncio.gather(*(self._apply_latest(h) for h in self.engines))

    async def _apply_latest(self, handle: EngineHandle | None) -> None:
        if self._latest_weights is None:
            return
        kind, source, version = self._latest_weights
        if kind == "colocated":  # every rank takes part (FSDP gathers); each loads the engine it hosts
            await asyncio.gather(*source.each("load_colocated_weights", version, self.cfg.weight_bucket_bytes))
            for h in self.engines:
                h.weight_version = self.weight_versions[h.index] = await self._client(h.url).weight_version()
            return
        if kind == "distributed":  # all engines, or a restarted one alone (in a group of its own, so the others go on)
            targets = self.engines if handle is None else [handle]
            await self._weight_sync.sync(source, [h.url for h in targets], self._client, version)
            for h in targets:
                h.weight_version = self.weight_versions[h.index] = await self._client(h.url).weight_version()
            return
        if kind == "disk":
            client = self._client(handle.url)
            await client.update_weights_from_disk(source, version)
            reported = (await client.get(sgl.ENDPOINTS["model_info"])).json().get("weight_version")
            reported = int(reported) if isinstance(reported, str) and reported.isdigit() else reported
        else:
            reported = await handle.actors[0].update_weights.remote(source, version, self.cfg.weight_bucket_bytes)
        handle.weight_version = self.weight_versions[handle.index] = reported

