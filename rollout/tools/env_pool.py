"""EnvPool: the environment of every multi-turn trajectory (rollout.env_path), and the event loop its calls run on.

One env per trajectory, keyed by (group id, sample index), built when the trajectory starts (`reset`) and kept while
the process lives. Calls run on the pool's own event loop (a daemon thread), so they overlap generation; the caller
gets concurrent.futures.Future objects and applies their outcomes to the dock itself (the dock stays one thread's).
A step for an env that is missing (a restart) or that missed an action (its call was cut off) first rebuilds it:
reset(sample), then the trajectory's earlier actions again, results ignored (see rollout/tools/env.py).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from spillover.infra.hooks import hook_point
from spillover.rollout.tools.env import ToolOutcome, guarded_call, load_env_factory

Key = tuple[int, int]  # (group id, sample index)


@dataclass
class _EnvState:
    env: Any
    actions: int = 0  # steps applied since reset


class EnvPool:
    def __init__(self, factory: Callable[[], Any], timeout_s: float, max_concurrent: int, on_error: str = "observe"):
        self.factory, self.timeout_s, self.on_error = factory, float(timeout_s), on_error
        self.max_concurrent = int(max_concurrent)
        self.envs: dict[Key, _EnvState] = {}  # touched on the pool's loop only (see _on_loop)
        self.rebuilds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._limit: asyncio.Semaphore | None = None

    @classmethod
    def from_config(cls, rollout_cfg) -> "EnvPool":
        """From the rollout section; the env_path is imported now (a bad one stops the run at start-up)."""
        return cls(load_env_factory(rollout_cfg.env_path), rollout_cfg.tool_timeout_s,
                   rollout_cfg.max_concurrent_tool_calls, rollout_cfg.on_tool_error)

    # ---- the loop ------------------------------------------------------------------------------------------
    def _submit(self, coro) -> Future:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="tool-envs", daemon=True)
            self._thread.start()
            self._limit = asyncio.run_coroutine_threadsafe(self._make_limit(), self._loop).result()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _make_limit(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_concurrent)

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        async def run():
            return fn()
        return self._submit(run()).result()

    def close(self) -> None:
        """Stop the loop (pending calls are cancelled) and forget every env."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None

        async def cancel_all():
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
        self.envs.clear()

    # ---- envs ----------------------------------------------------------------------------------------------
    def has(self, key: Key, actions: int) -> bool:
        """Is the env of `key` alive with exactly `actions` steps applied?"""
        state = self.envs.get(key)
        return state is not None and state.actions == actions

    def discard(self, key: Key) -> None:
        """Forget an env whose call was cut off (its state is unknown): the next step rebuilds it."""
        if self._loop is not None:
            self._on_loop(lambda: self.envs.pop(key, None))

    def keep_only(self, keys: set[Key]) -> None:
        """Forget the envs of trajectories that left the dock."""
        if self._loop is not None:
            self._on_loop(lambda: [self.envs.pop(k) for k in list(self.envs) if k not in keys])

    def reset(self, key: Key, sample) -> Future:
        """A new env for the trajectory -> Future[ToolOutcome] (its first observation)."""
        return self._submit(self._reset(key, sample))

    def step(self, key: Key, sample, history: list[str] | None, action: str, iteration: int) -> Future:
        """env.step(action) -> Future[ToolOutcome]; history (the earlier actions) rebuilds the env when it is
        missing or behind (None: it is known to be alive and current)."""
        return self._submit(self._step(key, sample, history, action, iteration))

    async def _new_env(self, key: Key, sample) -> tuple[_EnvState | None, ToolOutcome]:
        try:
            env = self.factory()
        except Exception as err:  # a factory that fails is the trajectory's error, not the run's
            end = self.on_error == "end"
            return None, ToolOutcome("" if end else f"error: {type(err).__name__}: {err}", done=end, error=True)
        outcome = await guarded_call(env, "reset", sample, self.timeout_s, self.on_error)
        state = _EnvState(env)
        self.envs[key] = state
        return state, outcome

    async def _reset(self, key: Key, sample) -> ToolOutcome:
        async with self._limit:
            return (await self._new_env(key, sample))[1]

    async def _step(self, key: Key, sample, history: list[str] | None, action: str, iteration: int) -> ToolOutcome:
        async with self._limit:
            state = self.envs.get(key)
            if state is None or (history is not None and state.actions != len(history)):
                self.rebuilds += 1
                state, outcome = await self._new_env(key, sample)
                if state is None:
                    return outcome
                for earlier in history or []:
                    await guarded_call(state.env, "step", earlier, self.timeout_s, self.on_error)
                    state.actions += 1
            hook_point("tool_step", iteration)
            outcome = await guarded_call(state.env, "step", action, self.timeout_s, self.on_error)
            state.actions += 1
            return outcome
