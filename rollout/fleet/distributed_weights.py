"""The manager's half of SGLang's distributed weight sync (the learner's half: tasks/learner/weight_sender.py).

Once per group: the learner's rank 0 hosts a weight-update group (rank 0) and every engine joins it through
`/init_weights_update_group` (engine e as ranks 1 + the tensor-parallel ranks of the engines before it), all
at the same time (the rendezvous needs every rank). Per sync: `/begin_weight_update` on every engine, then for
each bucket (engines.weight_bucket_bytes, whole tensors) `/update_weights_from_distributed` to every engine
while the learner broadcasts that bucket, then `/end_weight_update`.

A group's membership is fixed: when the engines change (one was restarted) or the learner does, the old group
is left on both sides and a new one (new name, new port) is formed before the next sync, so a restarted
engine rejoins and receives the current weights.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import httpx

from spillover.infra.config.engines import EnginesConfig
from spillover.rollout.sglang import backend as sgl
from spillover.rollout.sglang.update_group import plan_buckets

log = logging.getLogger(__name__)
DEFAULT_BUCKET_BYTES = 512 * 2**20


class DistributedWeightSync:
    """One weight-update group at a time between a learner (policy group handle) and the engines."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, ranks_per_engine: int = 1, backend: str = "gloo",
                 timeout_s: float = 600.0):
        self.bucket_bytes, self.ranks_per_engine = int(bucket_bytes), int(ranks_per_engine)
        self.backend, self.timeout_s = backend, float(timeout_s)
        self.group_name: str | None = None
        self._members: tuple[Any, tuple[str, ...]] | None = None  # (learner, engine urls) of the joined group
        self._usable = False  # False after a failed rendezvous: the group is left and formed anew
        self._prefix = f"spillover-{secrets.token_hex(4)}"
        self.epoch = 0
        self.last: dict[str, Any] = {}  # the last sync's numbers (buckets, bytes, sender's report)

    async def sync(self, policy: Any, urls: list[str], client: Callable[[str], Any], version: int | str) -> None:
        """Send the policy's current weights to every engine at `urls` as `version` (forms the group if needed)."""
        if not self._usable or self._members != (policy, tuple(urls)):
            await self.form(policy, urls, client)
        specs = await policy.weight_specs.remote()
        buckets = plan_buckets(specs, self.bucket_bytes)
        name, sending = self.group_name, None
        try:
            await asyncio.gather(*(client(u).post(sgl.ENDPOINTS["begin_weight_update"],
                                                  json=sgl.begin_weight_update_payload()) for u in urls))
            sending = asyncio.ensure_future(_awaited(
                policy.broadcast_weights.remote(name, [[n for n, _, _ in b] for b in buckets])))
            for bucket in buckets:
                names, dtypes, shapes = zip(*bucket)
                payload = sgl.update_from_distributed_payload(list(names), list(dtypes), list(shapes), version,
                                                              group_name=name)
                await _unless_sender_fails(asyncio.gather(*(
                    client(u).post(sgl.ENDPOINTS["update_from_distributed"], json=payload, timeout=self.timeout_s)
                    for u in urls)), sending)
            report = await sending
        except BaseException:
            if sending is not None:  # its outcome no longer matters (a sender still blocked fails once we leave)
                sending.add_done_callback(lambda done: done.cancelled() or done.exception())
            await self.leave(client, wait_learner=False)  # engines drop their ends: a blocked broadcast fails fast
            raise
        finally:  # also after a failure (or a begin refused on some engine): the next sync must be able to begin
            end = sgl.end_weight_update_payload()
            await asyncio.gather(*(client(u).post(sgl.ENDPOINTS["end_weight_update"], json=end) for u in urls),
                                 return_exceptions=True)
        self.last = {"buckets": len(buckets), "bucket_bytes": self.bucket_bytes, **report}

    async def form(self, policy: Any, urls: list[str], client: Callable[[str], Any]) -> None:
        """Leave the old group (best effort), then host a new one on the learner with every engine joined."""
        await self.leave(client)
        healthy = await asyncio.gather(*(client(u).health() for u in urls))
        if not all(healthy):  # a dead member would keep the rendezvous waiting: let the caller restart it first
            dead = [u for u, ok in zip(urls, healthy) if not ok]
            raise httpx.ConnectError(f"engines {dead} do not answer /health: not forming a weight-update group")
        self.epoch += 1
        name = f"{self._prefix}-{self.epoch}"
        address, port = await policy.weight_sync_address.remote()
        world_size = 1 + self.ranks_per_engine * len(urls)
        joins = [client(u).post(sgl.ENDPOINTS["init_update_group"], timeout=self.timeout_s,
                                json=sgl.init_update_group_payload(address, port, 1 + self.ranks_per_engine * i,
                                                                   world_size, name, self.backend))
                 for i, u in enumerate(urls)]
        hosting = policy.join_weight_group.remote(address, port, world_size, name, self.backend, self.timeout_s)
        outcomes = await asyncio.gather(hosting, *joins, return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        self.group_name, self._members, self._usable = name, (policy, tuple(urls)), not failures
        if failures:
            raise failures[0]
        log.info("weight-update group %s: learner + %d engines (world %d, %s)", name, len(urls), world_size,
                 self.backend)

    async def leave(self, client: Callable[[str], Any], wait_learner: bool = True) -> None:
        """Destroy the current group on the engines still in it and on the learner (errors ignored: some are gone).
        wait_learner=False: after a failed sync the learner may still be blocked in the broadcast (it fails once the
        engines' ends close); its leave is queued behind it, not awaited."""
        if self.group_name is None:
            return
        (policy, urls), name = self._members, self.group_name
        self.group_name, self._members, self._usable = None, None, False
        calls = [client(u).post(sgl.ENDPOINTS["destroy_update_group"], json={"group_name": name}, timeout=30.0)
                 for u in urls]
        learner_leave = policy.leave_weight_group.remote(name)
        await asyncio.gather(*calls, *([learner_leave] if wait_learner else []), return_exceptions=True)


async def _awaited(pending: Any) -> Any:
    return await pending


async def _unless_sender_fails(posts: Any, sending: asyncio.Future) -> Any:
    """The engines' posts of one bucket, given up as soon as the sender fails: the engines would otherwise wait in
    their broadcast receive until weight_sync_timeout_s (the caller then leaves the group, which ends those
    receives)."""
    posts = asyncio.ensure_future(posts)
    await asyncio.wait({posts, sending}, return_when=asyncio.FIRST_COMPLETED)
    if not posts.done() and sending.exception() is not None:
        posts.cancel()
        raise sending.exception()
    return await posts


def weight_sync_settings(cfg: EnginesConfig, use_gpu: bool) -> dict[str, Any]:
    """DistributedWeightSync's arguments from the engines config (NCCL between GPUs, gloo on CPU)."""
    return {"bucket_bytes": cfg.weight_bucket_bytes,
            "ranks_per_engine": cfg.gpus_per_engine if cfg.backend == "sglang" else 1,
            "backend": "nccl" if use_gpu else "gloo", "timeout_s": cfg.weight_sync_timeout_s}


def disk_folder(cfg: EnginesConfig, model_path: str, weight_version: int | str) -> str:
    """Where engines.weight_sync=disk exports version `weight_version` (engines.weight_sync_dir, or next to the
    model folder); every engine must be able to read it (one node, or a shared file system)."""
    from pathlib import Path

    root = cfg.weight_sync_dir or Path(model_path).parent / "synced_weights"
    return str(Path(root) / f"version-{weight_version}")
