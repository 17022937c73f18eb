"""Fault injection for crash tests: SPILLOVER_KILL_AT="<task>:<iteration>" makes the training process
SIGKILL itself when that task of that iteration starts (the kill -9 matrix in tests/e2e). Unset in
normal runs; reading one environment variable per task costs nothing.

Points: the seven task names of flows/train.py (at the task's start) and "checkpoint_manifest" (inside
infra.checkpoint.save_checkpoint, after every object of the checkpoint is written and before its manifest:
a half-written checkpoint)."""
from __future__ import annotations

import os
import signal

KILL_AT_ENV = "SPILLOVER_KILL_AT"


def maybe_kill(task_name: str, iteration: int) -> None:
    target = os.environ.get(KILL_AT_ENV)
    if target and target == f"{task_name}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)
