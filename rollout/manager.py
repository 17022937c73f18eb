"""RolloutManager: the engines on Ray behind the real sglang-router, as one object the flow holds.

All HTTP and Ray calls run on the manager's own event loop (a daemon thread), so the same manager is
usable from sync code (`generate`, `abort_all`, ...) and from any other event loop (`async_generate`,
`async_abort_all`, ...). `on_result(index, response)` callbacks run on that loop's thread: keep them short;
calling `abort_all()` from one schedules the abort and returns at once.

Failure handling: a request that fails in transport or with a 5xx (the router already retries on the
other workers) triggers one shared health check; an engine that does not answer /health_generate within
engines.health_timeout_s is killed, restarted in its own bundles with the latest weights and re-registered,
and the request is sent again. Bad requests (4xx) are the caller's: they raise after the batch finishes.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray

from infra.config import EnginesConfig
from rollout.engine_pool import EngineHandle, EnginePool, default_torch_threads
from rollout.engines import sglang_backend as sgl
from rollout.engines.client import EngineClient, EngineError
from rollout.engines.protocol import new_rid
from rollout.engines.router import Router

log = logging.getLogger(__name__)
OnResult = Callable[[int, dict], None]


@dataclass(eq=False)
class _Round:
    """One generate call: abort_all stops it; in_flight counts its requests still on the wire."""

    stopped: bool = False
    in_flight: int = 0


def aborted_response(body: dict, message: str) -> dict:
    """The SGLang-shaped answer of a request that was never sent (its round was stopped first)."""
    return {"output_ids": [], "meta_info": {
        "id": body["rid"], "finish_reason": {"type": "abort", "message": message},
        "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0, "weight_version": None,
        "output_token_logprobs": [] if body.get("return_logprob") else None}}


class RolloutManager:
    def __init__(self, engines_cfg: EnginesConfig, model_path: str | Path, *, health_interval_s: float | None = None,
                 max_attempts: int = 5, max_in_flight: int | None = None, **pool_options: Any):
        """Start the engines (see `EnginePool` for pool_options), the router, and register every engine."""
        from infra.cluster import init_ray

        if not ray.is_initialized():
            init_ray(engines_cfg.ray_address)
        self.cfg, self.model_path = engines_cfg, str(model_path)
        self.max_attempts = max_attempts
        self.max_in_flight = max_in_flight or engines_cfg.num_engines * engines_cfg.max_running_requests
        if engines_cfg.backend == "torch" and not pool_options.get("use_gpu"):
            pool_options.setdefault("torch_threads", default_torch_threads(engines_cfg.num_engines))
        self.pool_options = pool_options
        self.pool: EnginePool | None = None
        self.router: Router | None = None
        self.weight_versions: dict[int, int | str | None] = {}
        self.restarts = 0
        self._latest_weights: tuple[str, Any, int | str] | None = None  # ("disk" | "tensor", path | ref, version)
        self._offloaded = False
        self._rounds: set[_Round] = set()
        self._clients: dict[str, EngineClient] = {}
        self._health_task: asyncio.Future | None = None
        self._monitor: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-manager", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(health_interval_s))
        except BaseException:
            self.shutdown()
            raise

    # ---- running coroutines on the manager's loop ---------------------------------------------------
    def _call(self, coro: Coroutine) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking RolloutManager method was called on the manager's own loop (from an "
                               "on_result callback?): use the async_ method or abort_all(), which schedules")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _on_loop(self, coro: Coroutine) -> Any:
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _start(self, health_interval_s: float | None) -> None:
        self._engine_lock = asyncio.Lock()
        self.pool = await asyncio.to_thread(EnginePool, self.cfg, self.model_path, **self.pool_options)
        await self.pool.start_all()
        self.weight_versions = {h.index: h.weight_version for h in self.pool.engines}
        if self.cfg.router_address:
            self.router = await asyncio.to_thread(Router.connect, self.cfg.router_address)
        else:
            self.router = await asyncio.to_thread(Router.launch, "127.0.0.1")
        self._router_client = EngineClient(self.router.url)
        for handle in self.pool.engines:
            await asyncio.to_thread(self.router.add_worker, handle.url)
        if health_interval_s:
            self._monitor = asyncio.create_task(self._monitor_health(health_interval_s))

    # ---- views --------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineHandle]:
        return list(self.pool.engines) if self.pool else []

    @property
    def urls(self) -> list[str]:
        """Node-0 URL of every engine (the only URLs the router knows)."""
        return [h.url for h in self.engines if h.url]

    @property
    def router_url(self) -> str:
        return self.router.url

    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        return self._clients[url]

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, batch: list[dict], on_result: OnResult | None = None) -> list[dict]:
        """SGLang /generate answers for `batch` (dicts of input_ids, sampling_params, rid?, return_logprob?),
        in input order, through the router; on_result(index, answer) as each one finishes."""
        return self._call(self._generate_batch(batch, on_result))

    async def async_generate(self, batch: list[dict], on_result: OnResult | None = None) -> list[dict]:
        return await self._on_loop(self._generate_batch(batch, on_result))

    async def async_eval(self, batch: list[dict], on_result: OnResult | None = None) -> list[dict]:
        """Evaluation generation: the same path as training rollouts (abort_all stops it too)."""
        return await self.async_generate(batch, on_result)

    def eval(self, batch: list[dict], on_result: OnResult | None = None) -> list[dict]:
        return self.generate(batch, on_result)

    async def _generate_batch(self, batch: list[dict], on_result: OnResult | None) -> list[dict]:
        round_ = _Round()
        self._rounds.add(round_)
        limit = asyncio.Semaphore(self.max_in_flight)
        results: list[Any] = [None] * len(batch)

        async def run(index: int, item: dict) -> None:
            async with limit:
                results[index] = await self._generate_one(item, round_)
            if on_result is not None:
                on_result(index, results[index])

        try:
            outcomes = await asyncio.gather(*(run(i, item) for i, item in enumerate(batch)), return_exceptions=True)
        finally:
            self._rounds.discard(round_)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        return results

    async def _generate_one(self, item: dict, round_: _Round) -> dict:
        if "input_ids" not in item:
            raise ValueError("each generate() item needs 'input_ids' (prompt + partial response token ids)")
        body = {"input_ids": list(item["input_ids"]), "sampling_params": dict(item.get("sampling_params") or {}),
                "return_logprob": bool(item.get("return_logprob", True)), "rid": item.get("rid") or new_rid()}
        failure: Exception | None = None
        for attempt in range(self.max_attempts):
            if round_.stopped:
                return aborted_response(body, "aborted before it was sent (abort_all)")
            round_.in_flight += 1
            try:
                return (await self._router_client.post("/generate", json=body)).json()
            except EngineError as err:
                if err.status < 500:
                    raise ValueError(f"request {body['rid']} was refused: {err.message}") from None
                failure = err
            except httpx.HTTPError as err:
                failure = err
            finally:
                round_.in_flight -= 1
            log.warning("request %s failed (attempt %d/%d): %r", body["rid"], attempt + 1, self.max_attempts, failure)
            if not round_.stopped:
                await self._recover()
        raise RuntimeError(f"request {body['rid']} failed {self.max_attempts} times; last error: {failure!r}")

    # ---- abort ------------------------------------------------------------------------------------
    def abort_all(self, timeout_s: float = 60.0) -> None:
        """Stop every running generate round: unsent requests return as aborted, running ones return their
        tokens so far (finish_reason abort); blocks until the engines are idle (schedules only when called
        on the manager's loop, e.g. from an on_result callback)."""
        for round_ in self._rounds:  # client side first, so nothing new is sent
            round_.stopped = True
        if threading.current_thread() is self._thread:
            asyncio.ensure_future(self._abort_all(timeout_s))
            return
        self._call(self._abort_all(timeout_s))

    async def async_abort_all(self, timeout_s: float = 60.0) -> None:
        for round_ in self._rounds:
            round_.stopped = True
        await self._on_loop(self._abort_all(timeout_s))

    async def _abort_all(self, timeout_s: float) -> None:
        for round_ in self._rounds:
            round_.stopped = True
        deadline = time.monotonic() + timeout_s
        busy = list(self.urls)
        while busy:
            await asyncio.gather(*(self._abort_engine(url) for url in busy))
            await asyncio.sleep(0.05)
            idle = await asyncio.gather(*(self._idle(url) for url in busy))
            on_wire = sum(r.in_flight for r in self._rounds)
            busy = [url for url, ok in zip(busy, idle) if not ok] or (list(self.urls) if on_wire else [])
            if busy and time.monotonic() > deadline:
                raise TimeoutError(f"engines {busy} still busy {timeout_s} s after abort_all "
                                   f"({on_wire} requests on the wire)")

    async def _abort_engine(self, url: str) -> None:
        try:
            await self._client(url).abort(abort_all=True)
        except (httpx.HTTPError, EngineError) as err:  # a dead engine has nothing to abort
            log.warning("abort on %s failed: %r", url, err)

    async def _idle(self, url: str) -> bool:
        try:
            return (await self._client(url).loads()).idle
        except (httpx.HTTPError, EngineError):
            return True

    # ---- memory and weights -----------------------------------------------------------------------------
    def offload(self, tags: list[str] | None = None) -> None:
        """Release every engine's memory (weights and KV cache); the engines must be idle."""
        self._call(self._memory(sgl.ENDPOINTS["release_memory"], sgl.release_memory_payload(tags), True))

    def onload(self, tags: list[str] | None = None) -> None:
        self._call(self._memory(sgl.ENDPOINTS["resume_memory"], sgl.resume_memory_payload(tags), False))

    async def async_offload(self, tags: list[str] | None = None) -> None:
        await self._on_loop(self._memory(sgl.ENDPOINTS["release_memory"], sgl.release_memory_payload(tags), True))

    async def async_onload(self, tags: list[str] | None = None) -> None:
        await self._on_loop(self._memory(sgl.ENDPOINTS["resume_memory"], sgl.resume_memory_payload(tags), False))

    async def _memory(self, path: str, payload: dict, offloaded: bool) -> None:
        async with self._engine_lock:
            await asyncio.gather(*(self._client(url).post(path, json=payload) for url in self.urls))
            self._offloaded = offloaded

    def update_weights(self, weights: dict | ray.ObjectRef | str | Path, weight_version: int | str) -> dict[int, Any]:
        """Load new weights on every engine: a state dict (or its Ray ObjectRef, put once and shared) or an HF
        folder (SGLang's update_weights_from_disk). Returns engine index -> weight_version it reports."""
        return self._call(self._update_weights(weights, weight_version))

    async def async_update_weights(self, weights: Any, weight_version: int | str) -> dict[int, Any]:
        return await self._on_loop(self._update_weights(weights, weight_version))

    async def _update_weights(self, weights: Any, weight_version: int | str) -> dict[int, Any]:
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
            self._latest_weights = latest  # a restarted engine loads these
            outcomes = await asyncio.gather(*(self._apply_latest(h) for h in self.engines), return_exceptions=True)
            for handle, outcome in zip(self.engines, outcomes):
                if isinstance(outcome, BaseException):
                    log.warning("weight update on engine %d failed (%r): restarting it", handle.index, outcome)
                    await self._restart(handle.index)
        return dict(self.weight_versions)

    async def _apply_latest(self, handle: EngineHandle) -> None:
        if self._latest_weights is None:
            return
        kind, source, version = self._latest_weights
        if kind == "disk":
            await self._client(handle.url).update_weights_from_disk(source, version)
            reported = await self._client(handle.url).get(sgl.ENDPOINTS["model_info"])
            reported = reported.json().get("weight_version")
            reported = int(reported) if isinstance(reported, str) and reported.isdigit() else reported
        else:
            reported = await handle.actors[0].update_weights.remote(source, version)
        handle.weight_version = reported
        self.weight_versions[handle.index] = reported

    # ---- health -------------------------------------------------------------------------------------
    def health_check(self) -> dict[int, str]:
        """Probe every engine's /health_generate; restart the dead or hung ones. Returns index -> ok|restarted."""
        return self._call(self._health_check())

    async def async_health_check(self) -> dict[int, str]:
        return await self._on_loop(self._health_check())

    async def _health_check(self) -> dict[int, str]:
        async with self._engine_lock:
            timeout = self.cfg.health_timeout_s
            healthy = await asyncio.gather(*(self._client(h.url).health(generate=True, timeout_s=timeout)
                                             if h.url else _false() for h in self.engines))
            status = {}
            for handle, ok in zip(self.engines, healthy):
                if not ok:
                    await self._restart(handle.index)
                status[handle.index] = "ok" if ok else "restarted"
            return status

    async def _recover(self) -> None:
        """One health check shared by every request that failed meanwhile."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_check())
        try:
            await asyncio.shield(self._health_task)
        except Exception as err:  # the retry will fail again and say so
            log.warning("health check failed: %r", err)
        await asyncio.sleep(0.1)

    async def _restart(self, index: int) -> None:
        """Called with the engine lock held: replace engine `index` and put it back behind the router."""
        old = self.pool.engines[index]
        log.warning("restarting engine %d (%s)", index, old.url)
        if old.url:
            await asyncio.to_thread(self.router.remove_worker, old.url)
            client = self._clients.pop(old.url, None)
            if client is not None:
                await client.aclose()
        handle = await self.pool.restart_engine(index)
        self.weight_versions[index] = handle.weight_version
        await self._apply_latest(handle)
        if self._offloaded:
            await self._client(handle.url).post(sgl.ENDPOINTS["release_memory"], json=sgl.release_memory_payload())
        await asyncio.to_thread(self.router.add_worker, handle.url)
        self.restarts += 1

    async def _monitor_health(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._recover()
            except Exception as err:
                log.warning("health monitor: %r", err)

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the engines' actors (their servers first), remove the placement group, stop our router."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        for round_ in self._rounds:
            round_.stopped = True
        if self._monitor is not None:
            self._monitor.cancel()
        if self.router is not None and self.router.proc is None and self.pool is not None:
            for url in self.urls:  # an external router outlives us: take our workers off it
                await asyncio.to_thread(self.router.remove_worker, url)
        if self.pool is not None:
            await asyncio.to_thread(self.pool.shutdown)
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)
        for client in [*self._clients.values(), getattr(self, "_router_client", None)]:
            if client is not None:
                await client.aclose()
        self._clients.clear()

    def __enter__(self) -> "RolloutManager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _false() -> bool:
    return False
