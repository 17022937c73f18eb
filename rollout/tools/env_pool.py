"""EnvPool: the environment of every multi-turn trajectory (rollout.env_path).

One env per trajectory, keyed by (group id, sample index), built when the trajectory starts (`reset`) and kept while
the process lives. Its calls are coroutines that the driver's tool hooks (rollout/drivers/tool_turns.py) run on the
engine's event loop, the one the answers arrive on, so they overlap generation; `envs` is touched on that loop only
(`discard` and `keep_only` are called there too). The callers apply the outcomes to the dock themselves.
A step for an env that is missing (a restart) or that missed an action (its call was cut off) first rebuilds it:
reset(sample), then the trajectory's earlier actions again, results ignored (see rollout/tools/env.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from ...infra.config.rollout import RolloutConfig
from ...infra.hooks import hook_point
from ..sample import Sample
from .env import Env, ToolOutcome, guarded_call, load_env_factory

Key = tuple[int, int]  # (group id, sample index)


@dataclass
class _EnvState:
    env: Env
    actions: int = 0  # steps applied since reset


class EnvPool:
    def __init__(self, factory: Callable[[], Env], timeout_s: float, max_concurrent: int, on_error: str = "observe"):
        self.factory, self.timeout_s, self.on_error = factory, float(timeout_s), on_error
        self.max_concurrent = int(max_concurrent)
        self.envs: dict[Key, _EnvState] = {}
        self.rebuilds = 0
        self._limit: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> "EnvPool":
        """From the rollout section; the env_path is imported now (a bad one stops the run at start-up)."""
        return cls(load_env_factory(rollout_cfg.env_path), rollout_cfg.tool_timeout_s,
                   rollout_cfg.max_concurrent_tool_calls, rollout_cfg.on_tool_error)

    def _concurrency(self) -> asyncio.Semaphore:
        """At most max_concurrent calls at once, on the loop running them (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._limit is None or self._limit[0] is not loop:
            self._limit = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._limit[1]

    def close(self) -> None:
        """Forget every env (the calls still running were cancelled by the cut that ended their generation)."""
        self.envs.clear()

    # ---- envs ----------------------------------------------------------------------------------------------
    def has(self, key: Key, actions: int) -> bool:
        """Is the env of `key` alive with exactly `actions` steps applied?"""
        state = self.envs.get(key)
        return state is not None and state.actions == actions

    def discard(self, key: Key) -> None:
        """Forget an env whose call was cut off (its state is unknown): the next step rebuilds it."""
        self.envs.pop(key, None)

    def keep_only(self, keys: set[Key]) -> None:
        """Forget the envs of trajectories that left the dock."""
        for key in [k for k in self.envs if k not in keys]:
            del self.envs[key]

    async def reset(self, key: Key, sample: Sample) -> ToolOutcome:
        """A new env for the trajectory -> its first observation."""
        async with self._concurrency():
            return (await self._new_env(key, sample))[1]

    async def step(self, key: Key, sample: Sample | None, history: list[str] | None, action: str,
                   iteration: int) -> ToolOutcome:
        """env.step(action); history (the earlier actions) rebuilds the env when it is missing or behind (None: it is
        known to be alive and current; sample is then not needed)."""
        async with self._concurrency():
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

    async def _new_env(self, key: Key, sample: Sample | None) -> tuple[_EnvState | None, ToolOutcome]:
        try:
            env = self.factory()
        except Exception as err:  # a factory that fails is the trajectory's error, not the run's
            end = self.on_error == "end"
            return None, ToolOutcome("" if end else f"error: {type(err).__name__}: {err}", done=end, error=True)
        outcome = await guarded_call(env, "reset", sample, self.timeout_s, self.on_error)
        state = _EnvState(env)
        self.envs[key] = state
        return state, outcome
