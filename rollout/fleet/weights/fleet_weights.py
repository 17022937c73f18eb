"""How a WeightUpdate reaches the engines: one strategy per kind, and `FleetWeights`, the manager's weight component
(the update every engine serves, what a restarted engine loads, what comes back after a resume).

Every strategy has `load(update, engines, flush_cache)` (load it on those engines; each handle then holds the version
its engine reports) and `update(update, engines, restart, flush_cache)` (load it on the whole fleet, restarting engines
that die meanwhile). flush_cache=False while requests paused in_place keep their KV cache (rollout.overlap,
engines.pause_mode=in_place): SGLang reports an update whose cache flush fails as failed. A restarted engine always
flushes (nothing runs on it).
Disk and tensor load each engine on its own; distributed and colocated load every engine at once (one
weight-update group, every learner rank), and a restarted engine alone.

Distributed (the learner's half: tasks/learner/weight_sender.py): once per group, the learner's rank 0 hosts a
weight-update group (rank 0) and every engine joins it through `/init_weights_update_group` (engine e as ranks 1 + the
tensor-parallel ranks of the engines before it), all at the same time (the rendezvous needs every rank). Per sync:
`/begin_weight_update` on every engine, then for each bucket (engines.weight_bucket_bytes, whole tensors)
`/update_weights_from_distributed` to every engine while the learner broadcasts that bucket (the last bucket alone
carries the version and the cache flush: bucket_payloads), then `/end_weight_update`. A failed sync leaves the engines
at their old version; they are sent the update once more (dead ones restarted first). A group's membership is fixed:
when the engines change (one was restarted) or the learner does, the old group is left on both sides and a new one
(new name, new port) is formed before the next sync, so a restarted engine rejoins and receives the current weights.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import httpx
import ray

from ....infra.config.engines import EnginesConfig
from ..engine_client import EngineClient, EngineUnreachable
from ..engine_pool import EngineHandle
from ...contracts.fleet import PolicyLearner
from .weight_update import WeightKind, WeightUpdate, reported_version
from ...sglang import backend as sgl
from ...sglang.protocol import (BeginWeightUpdateRequest, DestroyWeightsUpdateGroupRequest, EndWeightUpdateRequest,
                                InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest)
from ...sglang.update_group import plan_buckets

log = logging.getLogger("spillover.rollout.fleet.manager")
# An engine that does not answer: its actor died, its server does not answer our client, or (httpx, through Ray) its
# actor's own posts to its server found none (WeightPoster).
ENGINE_GONE = (ray.exceptions.RayActorError, EngineUnreachable, httpx.TransportError)
DEFAULT_BUCKET_BYTES = 512 * 2**20
Client = Callable[[str], EngineClient]
Engines = Callable[[], list[EngineHandle]]  # the fleet's engines now (a restart replaces a handle)
Restart = Callable[[int], Awaitable[None]]  # replace engine i; it loads the latest update itself


class WeightStrategy(Protocol):
    async def load(self, update: WeightUpdate, engines: list[EngineHandle], flush_cache: bool = True) -> None: ...

    async def update(self, update: WeightUpdate, engines: Engines, restart: Restart,
                     flush_cache: bool = True) -> None: ...


async def note_reported(client: Client, engines: list[EngineHandle]) -> None:
    for handle in engines:
        handle.weight_version = reported_version(await client(handle.url).weight_version(), f"engine {handle.index}")


async def update_each_engine(strategy: WeightStrategy, update: WeightUpdate, engines: Engines,
                             restart: Restart, flush_cache: bool = True) -> None:
    """Load on every engine at once, each on its own: one that died meanwhile is restarted (and loads the update
    itself); an update an engine refused raises once the others are done."""
    current = engines()
    outcomes = await asyncio.gather(*(strategy.load(update, [h], flush_cache) for h in current),
                                    return_exceptions=True)
    for handle, outcome in zip(current, outcomes):
        if isinstance(outcome, ENGINE_GONE):
            log.warning("engine %d died during the weight update (%r): restarting it", handle.index, outcome)
            await restart(handle.index)
    refused = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, ENGINE_GONE)]
    if refused:
        raise refused[0]


class DiskWeights:
    """An HF folder: /update_weights_from_disk on each engine."""

    def __init__(self, client: Client):
        self.client = client

    async def load(self, update: WeightUpdate, engines: list[EngineHandle], flush_cache: bool = True) -> None:
        await asyncio.gather(*(self.client(h.url).update_weights_from_disk(update.source, update.version,
                                                                           flush_cache=flush_cache)
                               for h in engines))
        await note_reported(self.client, engines)

    async def update(self, update: WeightUpdate, engines: Engines, restart: Restart,
                     flush_cache: bool = True) -> None:
        await update_each_engine(self, update, engines, restart, flush_cache)


def put_each(state_dict: dict) -> dict:
    """{name: ObjectRef of that tensor}: engine actors fetch a bucket's tensors at a time (EngineActor.update_weights).
    ObjectRefs already there stay."""
    return {name: value if isinstance(value, ray.ObjectRef) else ray.put(value) for name, value in state_dict.items()}


class TensorWeights:
    """A state dict in Ray's object store, a tensor per object ({name: ObjectRef}, or that dict's ObjectRef: the
    learner's state_dict_refs): each engine actor fetches the tensors bucket by bucket and posts each bucket to its
    server inside one weight-update session, dropping it once posted (rollout/fleet/weights/weight_poster.py). A
    whole state dict's ObjectRef works too, but each engine actor then holds all of it."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    async def load(self, update: WeightUpdate, engines: list[EngineHandle], flush_cache: bool = True) -> None:
        reported = await asyncio.gather(*(h.actors[0].update_weights.remote(update.source, update.version,
                                                                            self.bucket_bytes, flush_cache)
                                          for h in engines))
        for handle, version in zip(engines, reported):
            handle.weight_version = reported_version(version, f"engine {handle.index}")

    async def update(self, update: WeightUpdate, engines: Engines, restart: Restart,
                     flush_cache: bool = True) -> None:
        await update_each_engine(self, update, engines, restart, flush_cache)


class ColocatedWeights:
    """Every policy rank takes part (FSDP gathers each bucket); each loads the engine it hosts
    (tasks/learner/engine_host.py), so a restarted engine is loaded by every rank too. Colocated engines are idle at
    an update (they release their memory for training), so it always flushes their cache."""

    def __init__(self, client: Client, bucket_bytes: int):
        self.client, self.bucket_bytes = client, bucket_bytes

    async def load(self, update: WeightUpdate, engines: list[EngineHandle], flush_cache: bool = True) -> None:
        if not flush_cache:
            raise ValueError("colocated engines cannot keep requests through a weight update (they release their "
                             "memory for training): rollout.overlap needs placement.colocate=false")
        await asyncio.gather(*update.source.each("load_colocated_weights", update.version, self.bucket_bytes))
        await note_reported(self.client, engines)

    async def update(self, update: WeightUpdate, engines: Engines, restart: Restart,
                     flush_cache: bool = True) -> None:
        await self.load(update, engines(), flush_cache)


class DistributedWeights:
    """One weight-update group at a time between the policy learner group and the engines."""

    def __init__(self, client: Client, bucket_bytes: int = DEFAULT_BUCKET_BYTES, ranks_per_engine: int = 1,
                 backend: str = "gloo", timeout_s: float = 600.0):
        self.client = client
        self.bucket_bytes, self.ranks_per_engine = int(bucket_bytes), int(ranks_per_engine)
        self.backend, self.timeout_s = backend, float(timeout_s)
        self.group_name: str | None = None
        self._members: tuple[PolicyLearner, tuple[str, ...]] | None = None  # (learner, engine urls) of the group
        self._usable = False  # False after a failed rendezvous: the group is left and formed anew
        self._prefix = f"spillover-{secrets.token_hex(4)}"
        self.epoch = 0
        self.last: dict[str, int | float] = {}  # the last sync's numbers (buckets, bytes, sender's report)

    async def load(self, update: WeightUpdate, engines: list[EngineHandle], flush_cache: bool = True) -> None:
        """All engines in one group, or a restarted one alone (in a group of its own, so the others go on)."""
        await self.sync(update.source, [h.url for h in engines], update.version, flush_cache)
        await note_reported(self.client, engines)

    async def update(self, update: WeightUpdate, engines: Engines, restart: Restart,
                     flush_cache: bool = True) -> None:
        try:
            await self.load(update, engines(), flush_cache)
        except Exception as failure:
            # The engines may hold some of the new buckets under their old version (it comes with the last bucket
            # only): dead ones are restarted (each loads this update as it rejoins), and every engine is sent the whole
            # update once more (the same weights and version: resending is safe). A second failure is raised, and the
            # engines still report the old version.
            log.warning("distributed weight sync of version %d failed (%r): restarting dead engines, syncing again",
                        update.version, failure)
            current = engines()
            alive = await asyncio.gather(*(self.client(h.url).health() for h in current))
            for handle in [h for h, ok in zip(current, alive) if not ok]:
                await restart(handle.index)  # joins a new group and gets the current weights
            await self.load(update, engines(), flush_cache)

    async def sync(self, policy: PolicyLearner, urls: list[str], version: int, flush_cache: bool = True) -> None:
        """Send the policy's current weights to every engine at `urls` as `version` (forms the group if needed);
        flush_cache=False: no bucket flushes the engines' cache (requests paused in_place keep theirs)."""
        if not self._usable or self._members != (policy, tuple(urls)):
            await self.form(policy, urls)
        client = self.client
        specs = await policy.weight_specs.remote()
        buckets = plan_buckets(specs, self.bucket_bytes)
        name, sending = self.group_name, None
        try:
            await asyncio.gather(*(client(u).post(sgl.ENDPOINTS["begin_weight_update"],
                                                  json=BeginWeightUpdateRequest().model_dump()) for u in urls))
            sending = asyncio.ensure_future(_awaited(
                policy.broadcast_weights.remote(name, [[n for n, _, _ in b] for b in buckets])))
            for payload in bucket_payloads(buckets, version, name, flush_cache):
                await _unless_sender_fails(asyncio.gather(*(
                    client(u).post(sgl.ENDPOINTS["update_from_distributed"], json=payload, timeout=self.timeout_s)
                    for u in urls)), sending)
            report = await sending
        except BaseException:
            if sending is not None:  # its outcome no longer matters (a sender still blocked fails once we leave)
                sending.add_done_callback(lambda done: done.cancelled() or done.exception())
            await self.leave(wait_learner=False)  # engines drop their ends: a blocked broadcast fails fast
            raise
        finally:  # also after a failure (or a begin refused on some engine): the next sync must be able to begin
            end = EndWeightUpdateRequest().model_dump()
            await asyncio.gather(*(client(u).post(sgl.ENDPOINTS["end_weight_update"], json=end) for u in urls),
                                 return_exceptions=True)
        self.last = {"buckets": len(buckets), "bucket_bytes": self.bucket_bytes, **report}

    async def form(self, policy: PolicyLearner, urls: list[str]) -> None:
        """Leave the old group (best effort), then host a new one on the learner with every engine joined."""
        await self.leave()
        client = self.client
        healthy = await asyncio.gather(*(client(u).health() for u in urls))
        if not all(healthy):  # a dead member would keep the rendezvous waiting: let the caller restart it first
            dead = [u for u, ok in zip(urls, healthy) if not ok]
            raise EngineUnreachable(f"engines {dead} do not answer /health: not forming a weight-update group")
        self.epoch += 1
        name = f"{self._prefix}-{self.epoch}"
        address, port = await policy.weight_sync_address.remote()
        world_size = 1 + self.ranks_per_engine * len(urls)
        joins = [client(u).post(sgl.ENDPOINTS["init_update_group"], timeout=self.timeout_s,
                                json=InitWeightsUpdateGroupRequest(
                                    master_address=address, master_port=port, rank_offset=1 + self.ranks_per_engine * i,
                                    world_size=world_size, group_name=name, backend=self.backend).model_dump())
                 for i, u in enumerate(urls)]
        hosting = policy.join_weight_group.remote(address, port, world_size, name, self.backend, self.timeout_s)
        outcomes = await asyncio.gather(hosting, *joins, return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        self.group_name, self._members, self._usable = name, (policy, tuple(urls)), not failures
        if failures:
            raise failures[0]
        log.info("weight-update group %s: learner + %d engines (world %d, %s)", name, len(urls), world_size,
                 self.backend)

    async def leave(self, wait_learner: bool = True) -> None:
        """Destroy the current group on the engines still in it and on the learner (errors ignored: some are gone).
        wait_learner=False: after a failed sync the learner may still be blocked in the broadcast (it fails once the
        engines' ends close); its leave is queued behind it, not awaited."""
        if self.group_name is None:
            return
        (policy, urls), name = self._members, self.group_name
        self.group_name, self._members, self._usable = None, None, False
        leave = DestroyWeightsUpdateGroupRequest(group_name=name).model_dump()
        calls = [self.client(u).post(sgl.ENDPOINTS["destroy_update_group"], json=leave, timeout=30.0) for u in urls]
        learner_leave = policy.leave_weight_group.remote(name)
        await asyncio.gather(*calls, *([learner_leave] if wait_learner else []), return_exceptions=True)


def bucket_payloads(buckets: list[list[tuple[str, str, list[int]]]], version: int, group_name: str,
                    flush_cache: bool) -> list[dict]:
    """One /update_weights_from_distributed body per bucket of (name, dtype, shape). Only the last carries the version
    and the cache flush: SGLang sets the version a body carries once that body's tensors are loaded, so a version on
    every bucket would label the engine new while later buckets are still old, and a sync failing midway would leave
    mixed weights under the new version."""
    payloads = []
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        names, dtypes, shapes = zip(*bucket)
        payloads.append(UpdateWeightsFromDistributedRequest(
            names=names, dtypes=dtypes, shapes=shapes, weight_version=version if last else None, group_name=group_name,
            flush_cache=flush_cache and last).model_dump())
    return payloads


async def _awaited(pending: ray.ObjectRef) -> dict[str, int | float]:
    return await pending


async def _unless_sender_fails(posts: Awaitable[list], sending: asyncio.Future) -> list:
    """The engines' posts of one bucket, given up as soon as the sender fails: the engines would otherwise wait in
    their broadcast receive until weight_sync_timeout_s (the caller then leaves the group, which ends those
    receives)."""
    posts = asyncio.ensure_future(posts)
    await asyncio.wait({posts, sending}, return_when=asyncio.FIRST_COMPLETED)
    if not posts.done() and sending.exception() is not None:
        posts.cancel()
        posts.add_done_callback(lambda done: done.cancelled() or done.exception())  # ends as cancelled: nothing to log
        raise sending.exception()
    return await posts


class FleetWeights:
    """What the engines serve and how updates reach them, for one RolloutManager (its engine lock held around every
    call). engines: the fleet's engines now; restart(i): the manager replaces engine i (which calls reload)."""

    def __init__(self, cfg: EnginesConfig, use_gpu: bool, client: Client, engines: Engines, restart: Restart):
        self.engines, self.restart = engines, restart
        self.latest: WeightUpdate | None = None  # what a restarted engine loads; None: the model folder it starts from
        self.disk = DiskWeights(client)
        self.tensor = TensorWeights(cfg.weight_bucket_bytes)
        self.distributed = DistributedWeights(client, **weight_sync_settings(cfg, use_gpu))
        self.colocated = ColocatedWeights(client, cfg.weight_bucket_bytes)

    def strategy(self, kind: WeightKind) -> WeightStrategy:
        return {"disk": self.disk, "tensor": self.tensor, "distributed": self.distributed,
                "colocated": self.colocated}[kind]

    async def update(self, update: WeightUpdate, flush_cache: bool = True) -> None:
        """flush_cache=False while requests paused in_place hold their KV cache."""
        if update.kind == "tensor" and isinstance(update.source, dict):  # in the object store once, for every engine,
            update = replace(update, source=await asyncio.to_thread(put_each, update.source))  # a tensor per object
        self.latest = update
        await self.strategy(update.kind).update(update, self.engines, self.restart, flush_cache)

    async def reload(self, handle: EngineHandle) -> None:
        """A restarted engine: the latest update (its start already loaded the model folder)."""
        if self.latest is not None:
            await self.strategy(self.latest.kind).load(self.latest, [handle])

    async def leave(self) -> None:
        """Leave the weight-update group (before new settings or another learner)."""
        await self.distributed.leave()


def policy_update(policy: PolicyLearner, version: int, cfg: EnginesConfig, model_path: str,
                  colocated: bool) -> WeightUpdate:
    """The policy learner's current weights as the update engines.weight_sync asks for: distributed (the group
    broadcasts), tensor (its state dict to Ray's object store) or disk (an HF folder the policy writes, waited for);
    colocated engines are loaded by the ranks that host them."""
    if colocated:
        return WeightUpdate("colocated", policy, version)
    if cfg.weight_sync == "distributed":
        return WeightUpdate("distributed", policy, version)
    if cfg.weight_sync == "tensor":
        return WeightUpdate("tensor", policy.state_dict_refs.remote(), version)
    return WeightUpdate("disk", ray.get(policy.save_weights.remote(disk_folder(cfg, model_path, version))), version)


def weight_sync_settings(cfg: EnginesConfig, use_gpu: bool) -> dict[str, int | float | str]:
    """DistributedWeights' settings from the engines config (NCCL between GPUs, gloo on CPU)."""
    return {"bucket_bytes": cfg.weight_bucket_bytes,
            "ranks_per_engine": cfg.gpus_per_engine if cfg.backend == "sglang" else 1,
            "backend": "nccl" if use_gpu else "gloo", "timeout_s": cfg.weight_sync_timeout_s}


def disk_folder(cfg: EnginesConfig, model_path: str, weight_version: int) -> str:
    """Where engines.weight_sync=disk exports version `weight_version` (engines.weight_sync_dir, or next to the
    model folder); every engine must be able to read it (one node, or a shared file system)."""
    root = cfg.weight_sync_dir or Path(model_path).parent / "synced_weights"
    return str(Path(root) / f"version-{weight_version}")
