"""The environment interface of multi-turn tool use (rollout.env_path) and the pieces around one env call.

An environment is built per sample by calling the object that `rollout.env_path` names with no arguments (a class,
or a factory function), and is used through two coroutines:

    async def reset(self, sample) -> str            # sample: spillover.rollout.sample.Sample (prompt tokens and text, label,
                                                    # metadata["data"]); the first observation ("" = none); a non-
                                                    # empty one goes into the response (loss mask 0) before the first
                                                    # generation
    async def step(self, action_text: str) -> StepResult(observation: str, done: bool, reward: float | None = None)

`action_text` is the model's turn up to and including the tool-call stop string (rollout.tool_call_stop). The
observation is appended to the trajectory as tool tokens (loss mask 0, cut to rollout.max_tool_output_tokens);
`done` ends the episode; the latest reward given is kept per trajectory (the reward function sees it as
sample.metadata["env_reward"]). Plain (non-async) methods run in a worker thread. Every call has a time limit
(rollout.tool_timeout_s) and at most rollout.max_concurrent_tool_calls run at once; an exception, a timeout or a
wrong return type becomes an error observation or ends the episode (rollout.on_tool_error), never a failed run.

Resuming: env objects live per trajectory while the process lives. After a restart (or when a call was cut off by
the end of an iteration) the env is rebuilt by `reset(sample)` and a replay of the trajectory's earlier actions
(their results are ignored), so a step must depend only on the env's reset and the actions before it
(deterministic, or idempotent for side effects) for a resumed trajectory to go on exactly as it would have.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...infra.imports import ImportPathError, load_function
from ..stop_strings import stop_window

TRUNCATION_MARKER = " ...truncated"


@dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool = False
    reward: float | None = None


class Env(Protocol):
    async def reset(self, sample) -> str: ...

    async def step(self, action_text: str) -> StepResult: ...


@dataclass(frozen=True)
class ToolOutcome:
    """One env call as the driver sees it: what to append, whether the episode ends, and what to count."""
    observation: str
    done: bool = False
    reward: float | None = None
    error: bool = False
    timed_out: bool = False
    latency_s: float = 0.0


def load_env_factory(path: str, setting: str = "rollout.env_path") -> Callable[[], Env]:
    """The class or factory at `path`; raises ImportPathError naming the setting when it cannot build an env."""
    factory = load_function(path, setting)
    try:
        inspect.signature(factory).bind()
    except TypeError as err:
        raise ImportPathError(f"{setting}={path!r} must be callable with no arguments (a class or factory that "
                              f"builds one env per sample): {err}") from None
    except ValueError:
        pass
    return factory


async def _call(method, arg) -> Any:
    if inspect.iscoroutinefunction(method):
        return await method(arg)
    result = await asyncio.to_thread(method, arg)
    return await result if inspect.isawaitable(result) else result


def _as_step_result(value: Any) -> StepResult:
    if isinstance(value, StepResult):
        return value
    if isinstance(value, str):
        return StepResult(value)
    raise TypeError(f"env.step returned {type(value).__name__}; it must return StepResult(observation, done, reward)")


async def guarded_call(env: Any, what: str, arg: Any, timeout_s: float, on_error: str) -> ToolOutcome:
    """env.reset(arg) (what="reset") or env.step(arg) (what="step") under the time limit -> ToolOutcome; an
    exception, a timeout or a bad return value becomes an error outcome (on_error "observe": its text is the
    observation; "end": the episode ends, nothing is appended)."""
    start = time.perf_counter()
    try:
        value = await asyncio.wait_for(_call(getattr(env, what), arg), timeout_s)
        if what == "reset":
            if value is not None and not isinstance(value, str):
                raise TypeError(f"env.reset returned {type(value).__name__}; it must return the first observation "
                                "as a string")
            return ToolOutcome(value or "", latency_s=time.perf_counter() - start)
        result = _as_step_result(value)
        reward = None if result.reward is None else float(result.reward)
        return ToolOutcome(str(result.observation), bool(result.done), reward, latency_s=time.perf_counter() - start)
    except asyncio.TimeoutError:
        return _error_outcome(f"error: tool timed out after {timeout_s:g} s", on_error, start, timed_out=True)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # any env failure is the trajectory's, never the run's
        return _error_outcome(f"error: {type(err).__name__}: {err}", on_error, start)


def _error_outcome(text: str, on_error: str, start: float, timed_out: bool = False) -> ToolOutcome:
    end = on_error == "end"
    return ToolOutcome("" if end else text, done=end, error=True, timed_out=timed_out,
                       latency_s=time.perf_counter() - start)


def observation_tokens(text: str, tokenizer, cap: int) -> list[int]:
    """The observation as token ids, at most `cap`: a longer one keeps its start and ends with TRUNCATION_MARKER."""
    if not text:
        return []
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) <= cap:
        return ids
    marker = list(tokenizer.encode(TRUNCATION_MARKER, add_special_tokens=False))
    if len(marker) >= cap:
        return ids[:cap]
    return ids[:cap - len(marker)] + marker


def split_actions(tokens: np.ndarray, mask: np.ndarray, stops: Sequence[str], decode) -> list[str]:
    """The tool calls of a trajectory, in order: within each run of policy tokens (mask 1), the text up to and
    including each tool-call stop string (as the engine stops there). Replaying them rebuilds an env."""
    tokens, window = np.asarray(tokens).tolist(), stop_window(stops)
    mask = np.asarray(mask).tolist()
    actions, start = [], None
    for j, (token, policy) in enumerate(zip(tokens, mask)):
        if not policy:
            start = None
            continue
        start = j if start is None else start
        if any(s in decode(tokens[max(start, j + 1 - window):j + 1]) for s in stops):
            actions.append(decode(tokens[start:j + 1]))
            start = j + 1
    return actions
