"""RolloutManager: the engines on Ray behind the real sglang-router, as one object the flow holds.

The API is synchronous. Every HTTP and Ray call runs on one event loop that the manager owns (an anyio
blocking portal: a thread), because its HTTP sessions and the background health monitor are bound to a
loop that outlives each call. `on_result(index, answer)` callbacks run on that loop's thread, so they must
be short and must not call the manager; one that returns True stops the round (every engine aborts, and
`generate` returns once they are idle).

Failures: a request that fails in transport or with a 5xx (the router has already retried the other
workers) triggers one shared health check; an engine that does not answer /health_generate within
engines.health_timeout_s is taken off the router and killed (so its requests fail over), restarted in its
own bundles with the latest weights, and registered again; the request is then sent again. Engines whose memory
is released (offload) are never probed: they cannot generate (SGLang's probe would run on freed memory).
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import ray
from anyio.from_thread import start_blocking_portal

from ...infra.config.engines import EnginesConfig
from .colocated_pool import ColocatedEnginePool
from .engine_pool import EngineHandle, EnginePool, default_torch_threads
from ..sglang import backend as sgl
from .engine_client import EngineClient
from .router import Router
from .generation import BatchGenerator
from .pinned_router import PinnedRouter
from ..contracts.fleet import OnResult, PolicyLearner
from ..sglang.protocol import (ContinueGenerationRequest, GenerateJob, GenerateResponse, PauseGenerationRequest,
                               ReleaseMemoryOccupationRequest, ResumeMemoryOccupationRequest)
from .weights.weight_update import WeightUpdate
from .weights.fleet_weights import ENGINE_GONE, FleetWeights, policy_update

# A colocated update resumes the weights' memory, loads them, then resumes the rest (SGLang's tags): the KV cache is
# not held while the learner's buckets arrive. SGLang releases and resumes CUDA graphs only when started with
# SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 (docs/gpu.md); the torch engine has none.
RESUME_BEFORE_LOAD = ("weights",)
RESUME_AFTER_LOAD = ("kv_cache", "cuda_graph")

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutManager:
    def __init__(self, engines_cfg: EnginesConfig, model_path: str | Path, *, max_attempts: int = 5,
                 max_in_flight: int | None = None, hosts: list[Any] | None = None, **pool_options: Any):
        """Start the engines (pool_options: see `EnginePool`), the router (or join engines_cfg.router_address),
        register every engine's node 0 with it; engines_cfg.health_interval_s > 0 starts the health monitor.
        hosts: the policy learner's rank actors, one engine in each (placement.colocate; rollout/fleet/colocated_pool.py)."""
        from ...infra.cluster import init_ray

        if not ray.is_initialized():
            init_ray(engines_cfg.ray_address)
        self.cfg, self.model_path = engines_cfg, str(model_path)
        if engines_cfg.backend == "torch" and not pool_options.get("use_gpu"):
            pool_options.setdefault("torch_threads", default_torch_threads(engines_cfg.num_engines))
        self.pool_options, self.hosts = pool_options, hosts
        self.pool: EnginePool | None = None
        self.router: Router | None = None
        self.weights: FleetWeights | None = None  # what the engines serve, how updates reach them
        self.restarts = 0
        self.overlap_counts = {"detached_tokens": 0, "updates_while_generating": 0, "tokens_cut_by_updates": 0,
                               "detached_generating_s": 0.0, "detached_span_s": 0.0}
        self._offloaded = False
        # an in_place update skipped its cache flush: prefixes cached under the old weights are flushed once idle
        self._stale_prefix_cache = False
        self._clients: dict[str, EngineClient] = {}
        self._exported_folder: str | None = None  # engines.weight_sync=disk: the folder of the version served
        self._engine_lock = asyncio.Lock()  # weight updates, memory release and resume, health checks and restarts
        self._health_task: asyncio.Future | None = None  # the health check shared by every failed request
        self._monitor: Future | None = None  # the background health monitor, while it runs
        self._gen: BatchGenerator | None = None
        self._portal_cm = start_blocking_portal("asyncio", name="rollout-manager")
        self._portal = self._portal_cm.__enter__()
        self._loop_thread = self._portal.call(threading.get_ident)
        # where on_result callbacks run; multi-turn env calls run there too (rollout/drivers/tool_turns.py)
        self.loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
        try:
            self._call(self._start, max_attempts, max_in_flight)
        except BaseException:
            self.shutdown()
            raise
        if engines_cfg.health_interval_s:
            self.start_health_monitor(engines_cfg.health_interval_s)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """fn(*args) on the manager's loop; blocks until it returns."""
        if self._portal is None:
            raise RuntimeError("this RolloutManager was shut down")
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("the RolloutManager was called from its own loop (an on_result callback?): a callback "
                               "must not call the manager; return True from on_result to stop the round instead")
        return self._portal.call(fn, *args)

    async def _start(self, max_attempts: int, max_in_flight: int | None) -> None:
        hosted = {"hosts": self.hosts} if self.colocated else {}
        self.pool = await asyncio.to_thread(ColocatedEnginePool if self.colocated else EnginePool, self.cfg,
                                            self.model_path, **hosted, **self.pool_options)
        await self.pool.start_all()
        if self.cfg.router_address:
            self.router = await asyncio.to_thread(Router.connect, self.cfg.router_address)
        else:
            self.router = await asyncio.to_thread(Router.launch, "127.0.0.1", None,
                                                  self.cfg.resolved_router_policy(self.cfg.backend))
        for handle in self.pool.engines:
            await asyncio.to_thread(self.router.add_worker, handle.url)
        self.weights = self._new_weights(self.cfg)
        router = PinnedRouter(EngineClient(self.router.url), lambda i: self.engines[i % len(self.engines)].url,
                              self._client)
        self._gen = BatchGenerator(router, lambda: self.urls, self._client, self._recover,
                                   max_attempts, max_in_flight or self.cfg.num_engines * self.cfg.max_running_requests)

    # ---- views --------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineHandle]:
        return list(self.pool.engines) if self.pool else []

    @property
    def colocated(self) -> bool:
        """The engines live in the policy learner's ranks (placement.colocate)."""
        return self.hosts is not None

    @property
    def urls(self) -> list[str]:
        """Node-0 URL of every engine (the only URLs the router knows)."""
        return [h.url for h in self.engines if h.url]

    @property
    def weight_versions(self) -> dict[int, int | None]:
        """The weight version each engine reported last (index -> version)."""
        return {h.index: h.weight_version for h in self.engines}

    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        return self._clients[url]

    # ---- generation (see rollout/fleet/generation.py) ------------------------------------------------------
    def generate(self, batch: list[GenerateJob], on_result: OnResult | None = None,
                 detach: bool = False) -> list[GenerateResponse | None]:
        """The /generate answers of `batch`, in input order, through the router. on_result(index, answer) runs on the
        manager's loop as each one finishes; returning True stops the round: every engine aborts (running requests
        come back with their tokens so far, unsent ones with none) and generate returns once the engines are idle. A
        job pinned to an engine goes to that engine, not through the router (rollout/fleet/pinned_router.py).
        detach=True (rollout.overlap): that True returns at once instead; the unanswered requests (None) run on,
        through weight updates (paused in engines.pause_mode; no cache flush under in_place), until
        collect_detached. detach=True without on_result returns at the call, every request running on. Requests
        adopted by collect_detached(adopt=True) join the call as indices len(batch) + k."""
        return self._call(self._gen.generate_round, batch, on_result, detach)

    def collect_detached(self, adopt: bool = False) -> dict[int, GenerateResponse]:
        """The last detached call's unanswered requests, what still runs aborted first: index -> answer. adopt
        (rollout.adopt_detached): only those that have answered; the others run on into the next generate call
        (indices len(batch) + k there)."""
        detached = self._gen.detached
        answers = self._call(self._collect_detached, adopt)
        self.overlap_counts["detached_tokens"] += sum(len(a.output_ids) for a in answers.values())
        if detached is not None:
            self.overlap_counts["tokens_cut_by_updates"] += detached.cut_tokens
            self.overlap_counts["detached_generating_s"] += detached.generating_s
            self.overlap_counts["detached_span_s"] += detached.span_s
        return answers

    async def _collect_detached(self, adopt: bool = False) -> dict[int, GenerateResponse]:
        answers = await self._gen.collect_detached(adopt)
        # the engines are idle now (what ran is aborted): flush what in_place kept. Adopted requests keep them busy;
        # their requests carry their weight version's extra_key, so no request reuses the old prefixes meanwhile
        if self._stale_prefix_cache and self._gen.adopted is None:
            async with self._engine_lock:
                refused = await self._each_engine("flush_cache", None)
            if refused is None:
                self._stale_prefix_cache = False
            else:  # another round (an eval's) still runs: the next update flushes instead
                log.warning("flush after an in_place update refused: %r", refused)
        return answers

    @property
    def detached_running(self) -> bool:
        """Requests of a detached round still run on the engines (rollout.overlap)."""
        detached = self._gen.detached
        return detached is not None and not detached.runs.done()

    def overlap_stats(self) -> dict[str, float]:
        """Counters since the manager started: detached_tokens (tokens answered by requests left running past
        their round), updates_while_generating, detached_generating_s of detached_span_s (of the seconds from a
        round's detach to its collection, those in which its requests still ran), and tokens_cut_by_updates (tokens
        of the requests an abort-mode pause ended: their answers keep them and the dock continues them next
        iteration, their KV recomputed then as prefill; 0 with in_place and retract, where the requests live through
        the update). No generated token is discarded by an update in any mode: in_place keeps the requests' KV,
        retract recomputes it, abort returns the tokens."""
        return dict(self.overlap_counts)

    @property
    def num_engines(self) -> int:  # what length-aware dispatch pins rows to (spillover.rollout.drivers.dispatch)
        return len(self.engines)

    def abort_all(self, timeout_s: float = 60.0) -> None:
        """From another thread than generate's: stop every running round and abort every engine; blocks until
        they are idle. (Inside a round, return True from on_result instead.)"""
        self._call(self._gen.abort_all, timeout_s)

    # ---- weights and memory ---------------------------------------------------------------------------
    def load_policy_weights(self, policy: PolicyLearner, version: int) -> dict[int, int | None]:
        """Every engine loads the policy's current weights as `version`, through the update this fleet's
        engines.weight_sync asks for (colocated engines: the ranks hosting them load them). With disk sync the
        folder of the version before is deleted once every engine serves the new one (a restart loads the newest):
        a folder a version would otherwise fill the disk over a run."""
        update = policy_update(policy, version, self.cfg, self.model_path, self.colocated)
        versions = self.update_weights(update)
        if update.kind == "disk":
            previous, self._exported_folder = self._exported_folder, str(update.source)
            if previous is not None and previous != self._exported_folder:
                shutil.rmtree(previous, ignore_errors=True)
        return versions

    def update_weights(self, update: WeightUpdate) -> dict[int, int | None]:
        """Load `update` on every engine (rollout/fleet/weights/fleet_weights.py: one strategy per kind); an engine
        that dies meanwhile is restarted and loads it too, as does any engine restarted later. Released colocated
        engines get their weights' memory back first, then the load, then their KV cache (and CUDA graphs). Returns
        engine index -> the version it reports."""
        return self._call(self._update_weights, update)

    async def _update_weights(self, update: WeightUpdate) -> dict[int, int | None]:
        async with self._engine_lock:  # an engine whose restart failed has no URL: the update would find none
            for handle in [h for h in self.engines if not h.url]:
                await self._restart(handle.index)
        if update.kind == "colocated" and self.detached_running:
            raise ValueError("a colocated weight update needs idle engines (they release their memory for training), "
                             "but detached requests still run: collect_detached() first (rollout.overlap needs "
                             "placement.colocate=false)")
        if update.kind == "colocated" and self._offloaded:
            # weights first, then the load, then the KV cache and CUDA graphs: resuming everything before the load
            # would hold the KV cache while the learner's buckets arrive (SGLang's tags; slime orders them so)
            async with self._engine_lock:
                await self._post_memory(False, list(RESUME_BEFORE_LOAD))
                await self.weights.update(update)
                self._stale_prefix_cache = False
                await self._post_memory(False, list(RESUME_AFTER_LOAD))
                self._offloaded = False
            return self.weight_versions
        async with self._engine_lock:
            if not self.detached_running:
                await self.weights.update(update)
                self._stale_prefix_cache = False
                return self.weight_versions
            # rollout.overlap: requests run on through the update; the engines pause them, load, and continue
            self.overlap_counts["updates_while_generating"] += 1
            mode = self.cfg.pause_mode
            if mode == "abort" and self._gen.detached is not None:  # before the pause: its aborted answers may
                self._gen.detached.note_abort_pause()               # arrive before the pause call returns
            # every engine that paused must continue, also when another one refused or died (the update restarts it)
            refused = await self._each_engine("pause_generation", PauseGenerationRequest(mode=mode).model_dump())
            try:
                if refused is not None:
                    raise refused
                # in_place: the paused requests keep their KV cache, which a flush would need gone; prefixes cached
                # under the old weights stay until collect_detached flushes them
                await self.weights.update(update, flush_cache=mode != "in_place")
                self._stale_prefix_cache = mode == "in_place"
            finally:
                refused = await self._each_engine("continue_generation", ContinueGenerationRequest().model_dump())
            if refused is not None:
                raise refused
        return self.weight_versions

    async def _each_engine(self, route: str, payload: dict) -> BaseException | None:
        """POST route to every engine at once; returns the first refusal. A dead engine's transport error is only
        logged: a weight update (or the health check) restarts it, and a restarted engine was never paused."""
        urls = self.urls
        outcomes = await asyncio.gather(*(self._client(u).post(sgl.ENDPOINTS[route], json=payload) for u in urls),
                                        return_exceptions=True)
        for url, outcome in zip(urls, outcomes):
            if isinstance(outcome, ENGINE_GONE):
                log.warning("/%s on %s failed: %r (the update restarts a dead engine)", route, url, outcome)
        return next((o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, ENGINE_GONE)), None)

    def _new_weights(self, engines_cfg: EnginesConfig) -> FleetWeights:
        return FleetWeights(engines_cfg, self.pool.use_gpu, self._client, lambda: self.engines, self._restart)

    def take_colocation_log(self) -> list[str]:
        """What rank 0's process did since the last take, in order (tasks/learner/engine_host.py)."""
        return ray.get(self.hosts[0].take_colocation_log.remote())

    def offload(self, tags: list[str] | None = None) -> None:
        """Release every engine's memory (SGLang tags: weights, kv_cache, cuda_graph); engines must be idle."""
        self._call(self._memory, True, tags)

    async def _memory(self, release: bool, tags: list[str] | None) -> None:
        """Release (offload) or resume every engine's memory; resumed weights come back empty, so a weight load
        follows (the colocated update's)."""
        async with self._engine_lock:
            await self._post_memory(release, tags)
            self._offloaded = release

    async def _post_memory(self, release: bool, tags: list[str] | None) -> None:
        """With the engine lock held: release or resume `tags` (None: all) on every engine."""
        path = sgl.ENDPOINTS["release_memory" if release else "resume_memory"]
        request = ReleaseMemoryOccupationRequest if release else ResumeMemoryOccupationRequest
        payload = request(tags=tags).model_dump()
        await asyncio.gather(*(self._client(url).post(path, json=payload) for url in self.urls))

    # ---- health -------------------------------------------------------------------------------------
    def start_health_monitor(self, interval_s: float) -> None:
        """Check every engine's health every interval_s in the background (restarting dead or hung ones);
        the constructor starts it when engines.health_interval_s > 0."""
        if interval_s <= 0:
            raise ValueError(f"start_health_monitor: interval_s must be > 0; got {interval_s}")
        self.stop_health_monitor()
        self._monitor = self._portal.start_task_soon(self._monitor_loop, interval_s)

    def stop_health_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()  # a check under way goes on (shielded): it may be restarting an engine
            self._monitor = None

    async def _monitor_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self._shared_health_check()

    async def _health_check(self) -> dict[int, str]:
        """Probe every engine's /health_generate; restart dead or hung ones. Engines whose memory is released
        (offload) are not probed: they cannot generate (SGLang's probe would run on freed memory and kill the server),
        and a restart would cut into the colocated update. Returns index -> ok | restarted | released."""
        async with self._engine_lock:
            if self._offloaded:
                return {h.index: "released" for h in self.engines}
            timeout = self.cfg.health_timeout_s
            healthy = await asyncio.gather(*(self._client(h.url).health(generate=True, timeout_s=timeout)
                                             if h.url else _false() for h in self.engines))
            for handle, ok in zip(self.engines, healthy):
                if not ok:
                    await self._restart(handle.index)
            return {h.index: "ok" if ok else "restarted" for h, ok in zip(self.engines, healthy)}

    async def _shared_health_check(self) -> None:
        """One health check shared by every request that failed meanwhile and the monitor."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_check())
        try:
            await asyncio.shield(self._health_task)
        except Exception as err:  # a failed request's retry fails again and says why
            log.warning("health check failed: %r", err)

    async def _recover(self) -> None:
        await self._shared_health_check()
        await asyncio.sleep(0.1)

    async def _restart(self, index: int) -> None:
        """With the engine lock held: replace engine `index` and put it back behind the router."""
        old = self.pool.engines[index]
        log.warning("restarting engine %d (%s)", index, old.url)
        if old.url:
            await asyncio.to_thread(self.router.remove_worker, old.url)
            client = self._clients.pop(old.url, None)
            if client is not None:
                await client.aclose()
        handle = await self.pool.restart_engine(index)
        try:
            await self.weights.reload(handle)
            if self._offloaded:
                await self._client(handle.url).post(sgl.ENDPOINTS["release_memory"],
                                                    json=ReleaseMemoryOccupationRequest().model_dump())
            await asyncio.to_thread(self.router.add_worker, handle.url)
        except BaseException:  # up but not behind the router: stopped, its URL cleared, so the next check restarts it
            await asyncio.to_thread(self.pool.kill_engine, index, False)
            raise
        self.restarts += 1

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the engines' actors (their servers first), free the placement group, stop our router."""
        if self._portal is None:
            return
        self.stop_health_monitor()
        try:
            self._call(self._shutdown)
        finally:
            self._portal, portal_cm = None, self._portal_cm
            portal_cm.__exit__(None, None, None)

    async def _shutdown(self) -> None:
        if self._gen is not None:
            self._gen.stop_rounds()
        if self._health_task is not None and not self._health_task.done():  # it may be restarting an engine
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.router is not None and self.router.proc is None and self.pool is not None:
            for url in self.urls:  # an external router outlives us: take our workers off it
                await asyncio.to_thread(self.router.remove_worker, url)
        try:
            if self.pool is not None:
                await asyncio.to_thread(self.pool.shutdown)
        finally:  # the router and the clients go also when an engine's kill failed
            if self.router is not None:
                await asyncio.to_thread(self.router.stop)
            clients = [*self._clients.values(), *([self._gen.router] if self._gen else [])]
            await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
            self._clients.clear()

    def __enter__(self) -> "RolloutManager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _false() -> bool:
    return False
