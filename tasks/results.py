"""What the tasks of one iteration hand each other: small immutable results, passed along by the flow as
local variables (tensors stay in the learner actors or Ray's object store; the flow holds references).

The metrics contract: each result carries its metrics under plain names (what metrics.jsonl stores) and
its stage's wandb prefix (`PREFIX`); timings (`*_s`) go under `time/` whatever the stage. Eval metrics
are already namespaced (`eval/<set>`), so their prefix is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..rollout.batch import RolloutBatch

Scalar = (int, float, bool, np.integer, np.floating)


@dataclass(frozen=True)
class StageResult:
    PREFIX: ClassVar[str] = "rollout/"
    metrics: dict = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """The numeric metrics under their wandb names."""
        out = {}
        for key, value in self.metrics.items():
            if isinstance(value, Scalar) and not isinstance(value, str):
                out[f"time/{key}" if key.endswith("_s") else f"{self.PREFIX}{key}"] = value
        return out


@dataclass(frozen=True)
class Loaded(StageResult):
    """load_prompts: groups put into the dock this iteration."""
    groups: int = 0


@dataclass(frozen=True)
class Rollout(StageResult):
    """generate_until_ready: the iteration's batch (not yet scored) and the generation stats.
    from_dock: the batch's groups sit in the dock (built-in partial rollout) and leave it at clear."""
    batch: RolloutBatch | None = None
    from_dock: bool = False


@dataclass(frozen=True)
class Scored(StageResult):
    """compute_reward: the batch with advantages, put in Ray's object store once for every consumer."""
    batch_ref: Any = None
    token_versions: tuple[int, int] = (0, 0)  # (oldest, newest) weight version of the batch's tokens
    sft: bool = False


@dataclass(frozen=True)
class Logprobs(StageResult):
    """compute_ref_logprob / compute_old_logprob: float32[Tr] in Ray's object store, or None (source says
    why: no reference model, or the rollout logprobs stand in for old logprobs)."""
    PREFIX: ClassVar[str] = "train/"
    ref: Any = None
    source: str = ""


@dataclass(frozen=True)
class Updated(StageResult):
    """update: the learner's metrics and the weight version the engines now serve."""
    PREFIX: ClassVar[str] = "train/"
    weight_version: int = 0


@dataclass(frozen=True)
class Evaluated(StageResult):
    PREFIX: ClassVar[str] = ""


@dataclass(frozen=True)
class Cleared(StageResult):
    """clear_and_age_sort: which groups were trained (stream ids and data set indices) and what stays."""
    trained_stream_ids: tuple[int, ...] = ()
    trained_group_ids: tuple[int, ...] = ()

    def scalars(self) -> dict[str, float]:
        ages = {f"rollout/rows_age_{age}": int(n) for age, n in (self.metrics.get("age_histogram") or {}).items()}
        return {**super().scalars(), **ages}


@dataclass(frozen=True)
class Checkpointed(StageResult):
    PREFIX: ClassVar[str] = "train/"
    prefix: str | None = None  # the checkpoint's storage prefix; None: not this iteration


def iteration_row(iteration: int, stages: list[StageResult], task_s: dict[str, float]) -> dict:
    """One metrics.jsonl row: every stage's metrics under plain names, plus the task times."""
    row: dict[str, Any] = {"iteration": iteration}
    for stage in stages:
        row.update(stage.metrics)
    row["task_s"] = dict(task_s)
    return row


def iteration_scalars(stages: list[StageResult], task_s: dict[str, float]) -> dict[str, float]:
    """The same iteration for wandb: numeric metrics under train/, rollout/, eval/ and time/."""
    out: dict[str, float] = {}
    for stage in stages:
        out.update(stage.scalars())
    out.update({f"time/task_{name}_s": float(s) for name, s in task_s.items()})  # wall time, Prefect included
    return out
