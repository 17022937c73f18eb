"""A hook point for test plugins: `hook_point(name, iteration)` at named points of a run (each task's start;
"checkpoint_manifest": every object of a checkpoint written, its manifest not yet; "tool_step": a multi-turn env
step about to run, rollout/tools/env_pool.py).

Normal runs set nothing and a point costs one environment read. With SPILLOVER_TEST_HOOKS naming an
importable module (e.g. `kill_hook`, tests/e2e/kill_hook.py, which SIGKILLs the process at a chosen point),
that module is imported once (Python's module cache) and its `on_point(name, iteration)` is called.
"""
from __future__ import annotations

import importlib
import os

HOOKS_ENV = "SPILLOVER_TEST_HOOKS"


class HookError(RuntimeError):
    """SPILLOVER_TEST_HOOKS names a module that cannot be imported or has no on_point."""


def hook_point(name: str, iteration: int) -> None:
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        return
    try:
        on_point = importlib.import_module(spec).on_point
    except (ImportError, AttributeError) as err:
        raise HookError(f"{HOOKS_ENV}={spec!r} must name an importable module with on_point(name, iteration) "
                        f"(unset it outside tests): {err}") from None
    on_point(name, iteration)
