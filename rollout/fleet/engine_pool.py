"""Rollout engines on Ray (as in slime's `create_rollout_engines`): a placement group with one bundle per
GPU (or CPU slot), engines = rollout_num_gpus // gpus_per_engine, one `EngineActor` per node of each
engine, ports found free on each node and never reused there, every engine healthy before use.

A multi-node engine (gpus_per_engine > slots_per_node) has one actor per node; only its node-0 actor
serves HTTP and is registered with the router, so requests reach it only there.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ...infra.config.engines import EnginesConfig
from .engine_actor import EngineActor
from ...infra.config.sglang_flags import sglang_launch_options

MIN_BUNDLE_CPU = 0.01  # Ray bundles must hold something; CPU engines reserve almost nothing (see MACHINE-NOTES)
GPU_ACTOR_FRACTION = 0.2  # the actor only supervises; the SGLang process uses the bundle's whole GPU
PLACEMENT_TIMEOUT_S = 120.0  # the resources exist (checked first) but may be held by others for a while
NOSET_VISIBLE_DEVICES = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


@dataclass
class EngineHandle:
    """One engine: its actors (node 0 first), the bundles they sit on, and node 0's URL."""

    index: int
    actors: list[Any]
    bundles: list[int]  # placement-group bundle of each actor
    node_ids: list[str]
    url: str | None = None
    pids: list[int] = field(default_factory=list)  # actor processes
    server_pgids: list[int | None] = field(default_factory=list)  # SGLang server process groups (own session)
    weight_version: int | None = None  # what the engine reported last


@ray.remote(num_cpus=0)
def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@ray.remote(num_cpus=0)
def _where() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def bundle_order(locations: list[tuple[str, list[int]]]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of first appearance), then by GPU id.

    `locations[i]` = (node_id, gpu_ids) of bundle i. Grouping makes each engine's bundles contiguous
    on a node, as slime's reordered_bundle_indices does.
    """
    first_seen: dict[str, int] = {}
    for i, (node, _) in enumerate(locations):
        first_seen.setdefault(node, i)
    return sorted(range(len(locations)),
                  key=lambda i: (first_seen[locations[i][0]], locations[i][1][:1] or [-1], i))


def engine_layout(num_slots: int, gpus_per_engine: int, slots_per_node: int) -> list[list[int]]:
    """Positions (in bundle order) of each engine's node actors: engine e, node k -> e*gpe + k*per_node."""
    per_node = min(gpus_per_engine, slots_per_node)
    if gpus_per_engine > slots_per_node and gpus_per_engine % slots_per_node:
        raise ValueError(f"engines.gpus_per_engine ({gpus_per_engine}) spans nodes, so it must be a multiple of "
                         f"the slots per node ({slots_per_node})")
    return [[e * gpus_per_engine + k * per_node for k in range(gpus_per_engine // per_node)]
            for e in range(num_slots // gpus_per_engine)]


def _cluster_has_gpus(needed: int) -> bool:
    return ray.cluster_resources().get("GPU", 0) >= needed


def _max_gpus_per_node() -> int:
    return int(max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0))


class EnginePool:
    """The placement group, the engines on it, and what is needed to restart one in its own bundles."""

    def __init__(self, cfg: EnginesConfig, model_path: str, *, slots_per_node: int | None = None,
                 strategy: str = "PACK", use_gpu: bool | None = None, seed: int = 0,
                 weight_version: int = 0, torch_threads: int | None = None,
                 max_model_len: int | None = None, sglang_options: dict[str, Any] | None = None,
                 start_timeout_s: float = 600.0, deterministic_inference: bool = False):
        self.cfg, self.model_path = cfg, str(model_path)
        self.use_gpu = (cfg.backend == "sglang" or _cluster_has_gpus(cfg.rollout_num_gpus)) if use_gpu is None \
            else use_gpu
        if cfg.backend == "sglang" and not self.use_gpu:
            raise ValueError("engines.backend 'sglang' needs GPUs in the Ray cluster; use engines.backend=torch on CPU")
        self.slots_per_node = slots_per_node or (_max_gpus_per_node() if self.use_gpu else cfg.gpus_per_engine)
        self.seed, self.weight_version = seed, weight_version
        if cfg.backend == "sglang":  # engines.sglang_args (+ --enable-deterministic-inference) as server flags
            sglang_options = sglang_launch_options(cfg, sglang_options, deterministic_inference)
        self.actor_kwargs = dict(max_running_requests=cfg.max_running_requests, torch_threads=torch_threads,
                                 max_model_len=max_model_len, sglang_options=sglang_options)
        self.start_timeout_s = start_timeout_s
        self.ports_in_use: dict[str, set[int]] = defaultdict(set)  # node_id -> ports handed out there
        self.engines: list[EngineHandle] = []
        self.pg = self._reserve(strategy)
        try:
            self.bundle_locations = self._locate_bundles()
            self.order = bundle_order(self.bundle_locations)
            self.layout = engine_layout(cfg.rollout_num_gpus, cfg.gpus_per_engine, self.slots_per_node)
            self._check_layout()
        except BaseException:
            remove_placement_group(self.pg)
            raise

    # ---- placement ----------------------------------------------------------------------------------
    def _locate_bundles(self) -> list[tuple[str, list[int]]]:
        """(node id, GPU ids) of each bundle. Without GPUs the placement group table has the nodes, which saves
        starting a task worker (~1 s and a process per run); GPU ids are only known inside the bundle."""
        count = self.cfg.rollout_num_gpus
        if not self.use_gpu:
            nodes = placement_group_table(self.pg)["bundles_to_node_id"]
            return [(nodes[i], []) for i in range(count)]
        return ray.get([_where.options(num_gpus=0.01, scheduling_strategy=self._in_bundle(i)).remote()
                        for i in range(count)])

    def _bundle_cpu(self) -> float:
        return max(self.cfg.num_cpus_per_engine / self.cfg.gpus_per_engine, MIN_BUNDLE_CPU)

    def _reserve(self, strategy: str) -> PlacementGroup:
        bundle: dict[str, float] = {"CPU": self._bundle_cpu()}
        if self.use_gpu:
            bundle = {"GPU": 1, "CPU": max(bundle["CPU"], GPU_ACTOR_FRACTION)}
        total = ray.cluster_resources()
        for name, amount in bundle.items():
            if total.get(name, 0) < amount * self.cfg.rollout_num_gpus:
                raise RuntimeError(f"engines.rollout_num_gpus={self.cfg.rollout_num_gpus} needs {name} "
                                   f"{amount * self.cfg.rollout_num_gpus:g} but the Ray cluster has {total.get(name, 0):g}: "
                                   "lower engines.rollout_num_gpus (or num_cpus_per_engine) or add nodes")
        pg = placement_group([dict(bundle) for _ in range(self.cfg.rollout_num_gpus)], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"the Ray cluster cannot place {self.cfg.rollout_num_gpus} engine bundles of {bundle} "
                               f"with strategy {strategy}: lower engines.rollout_num_gpus or add nodes") from None
        return pg

    def _in_bundle(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=True)

    def _check_layout(self) -> None:
        per_node = min(self.cfg.gpus_per_engine, self.slots_per_node)
        for e, positions in enumerate(self.layout):
            for pos in positions:
                nodes = {self.bundle_locations[self.order[pos + j]][0] for j in range(per_node)}
                if len(nodes) != 1:
                    raise ValueError(f"engine {e}: its {per_node} slots starting at bundle position {pos} are split "
                                     f"over {len(nodes)} nodes; set slots_per_node to the GPUs (slots) per node")

    # ---- engines ------------------------------------------------------------------------------------
    def new_actors(self, index: int) -> tuple[list[Any], list[int]]:
        """Engine `index`'s actors (node 0 first), created in their bundles but not serving yet."""
        remote_cls = ray.remote(EngineActor)
        nnodes = len(self.layout[index])
        actors, bundles = [], []
        for node_rank, pos in enumerate(self.layout[index]):
            bundle = self.order[pos]
            options: dict[str, Any] = dict(num_cpus=self._bundle_cpu(), scheduling_strategy=self._in_bundle(bundle),
                                           max_concurrency=8, max_restarts=0)
            if self.use_gpu:
                options.update(num_cpus=GPU_ACTOR_FRACTION, num_gpus=GPU_ACTOR_FRACTION)
                if self.cfg.backend == "sglang":
                    options["runtime_env"] = {"env_vars": dict(NOSET_VISIBLE_DEVICES)}
            actors.append(remote_cls.options(**options).remote(
                self.cfg.backend, self.model_path, index, node_rank=node_rank, nnodes=nnodes,
                tp_size=self.cfg.gpus_per_engine, seed=self.seed + index, weight_version=self.weight_version,
                **self.actor_kwargs))
            bundles.append(bundle)
        return actors, bundles

    async def start_engine(self, index: int) -> EngineHandle:
        """Create engine `index`'s actors in its bundles, give them ports, wait until node 0 is healthy."""
        actors, bundles = self.new_actors(index)
        try:
            return await self._start_actors(index, actors, bundles)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise

    async def _start_actors(self, index: int, actors: list[Any], bundles: list[int]) -> EngineHandle:
        infos = [await a.info.remote() for a in actors]
        ports = [[0, None, None] for _ in actors]  # the torch server binds port 0 itself: no clash possible
        if self.cfg.backend == "sglang":  # http, nccl, dist-init ports, found on each actor's own node
            for k, (actor, info) in enumerate(zip(actors, infos)):
                ports[k] = await actor.free_ports.remote(3, sorted(self.ports_in_use[info["node_id"]]))
                self.ports_in_use[info["node_id"]].update(ports[k])
        dist_init = f"{infos[0]['host']}:{ports[0][2]}" if len(actors) > 1 else None
        base_gpus = [self.bundle_locations[b][1][0] if self.use_gpu else 0 for b in bundles]
        starts = [a.start.remote(port=ports[k][0], nccl_port=ports[0][1], dist_init_addr=dist_init,
                                 base_gpu_id=base_gpus[k], timeout_s=self.start_timeout_s)
                  for k, a in enumerate(actors)]
        urls = [await s for s in starts]
        pgids = [(await a.info.remote())["server_pgid"] for a in actors]
        return EngineHandle(index=index, actors=actors, bundles=bundles, node_ids=[i["node_id"] for i in infos],
                            url=urls[0], pids=[i["pid"] for i in infos], server_pgids=pgids,
                            weight_version=self.weight_version)

    async def start_all(self) -> list[EngineHandle]:
        import asyncio

        results = await asyncio.gather(*(self.start_engine(i) for i in range(len(self.layout))),
                                       return_exceptions=True)
        self.engines = [r for r in results if isinstance(r, EngineHandle)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return self.engines

    async def restart_engine(self, index: int) -> EngineHandle:
        """Kill engine `index` (dead or hung) and start a fresh one in the same bundles."""
        import asyncio

        await asyncio.to_thread(self.kill_engine, index, False)
        self.engines[index] = await self.start_engine(index)
        return self.engines[index]

    def kill_engine(self, index: int, graceful: bool = True) -> None:
        """Kill engine `index`'s actors (after asking them to stop their servers when `graceful`); its bundles
        stay reserved. SGLang servers are separate processes: they are always stopped, and if an actor is
        already dead, its server's process group is killed by a task on that node."""
        handle = self.engines[index]
        if graceful or self.cfg.backend == "sglang":
            try:
                ray.get([a.stop.remote() for a in handle.actors], timeout=20 if graceful else 5)
            except Exception:  # dead or hung: ray.kill below takes the actor, the reaper its server
                pass
        for actor in handle.actors:
            ray.kill(actor, no_restart=True)
        reaps = [_kill_group.options(scheduling_strategy=self._in_bundle(bundle)).remote(pgid)
                 for bundle, pgid in zip(handle.bundles, handle.server_pgids) if pgid]
        ray.get(reaps, timeout=30)
        handle.url = None

    def shutdown(self) -> None:
        """Every engine killed and the placement group freed, also when one kill fails (its error raised after)."""
        failed: list[BaseException] = []
        for index in range(len(self.engines)):
            try:
                self.kill_engine(index)
            except Exception as err:
                failed.append(err)
        remove_placement_group(self.pg)
        if failed:
            raise failed[0]


def default_torch_threads(num_engines: int) -> int:
    """Threads per CPU engine so that the engines together use the machine's cores once."""
    return max(1, (os.cpu_count() or 1) // max(1, num_engines))
