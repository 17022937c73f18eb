"""Test plugin for the kill -9 matrix, loaded by infra/hooks.py when SPILLOVER_TEST_HOOKS=kill_hook (tests/e2e
on PYTHONPATH): SPILLOVER_KILL_AT="<point>:<iteration>" makes the training process SIGKILL itself at that
point. Points: the task names of flows/train.py (at each task's start) and "checkpoint_manifest" (in
spillover.infra.storage.checkpoint.save_checkpoint, after every object of the checkpoint is written and before its manifest:
a half-written checkpoint)."""
from __future__ import annotations

import os
import signal

KILL_AT_ENV = "SPILLOVER_KILL_AT"


def on_point(name: str, iteration: int) -> None:
    if os.environ.get(KILL_AT_ENV) == f"{name}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)
