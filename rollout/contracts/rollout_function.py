"""Rollout and eval functions loaded by import path, and the shape check of what they return.

The contract is slime's: `generate_rollout(args, rollout_id, data_source, evaluation=False)` returns
groups of samples (`list[list[Sample]]`), or a `RolloutOutput` (the batch as samples or columns, plus
generation stats). `args` is the RunConfig; `data_source` a spillover.rollout.context.RolloutContext (dock, engines,
tokenizer, prompts, weight version). Nested results are flattened into groups, a flat list of samples is
grouped by `group_index`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...infra.imports import ImportPathError, load_function
from ..batch import RolloutBatch, is_sft_batch
from ..sample import Sample

ROLLOUT_PARAMS = ("args", "rollout_id", "data_source")
ROLLOUT_KEYWORDS = ("evaluation",)

RolloutFunction = Callable[..., Any]


class RolloutResultError(TypeError):
    """A rollout function returned something that is not samples in groups."""


def load_rollout_function(path: str, setting: str) -> RolloutFunction:
    """Import `path` and check it can be called as fn(args, rollout_id, data_source, evaluation=...).

    A wrong path or signature raises ImportPathError naming `setting` and `path` (call this at start-up).
    """
    return load_function(path, setting, ROLLOUT_PARAMS, ROLLOUT_KEYWORDS)


def flatten_rollout(result: Any, source: str = "the rollout function") -> list[list[Sample]]:
    """A rollout function's result -> groups of samples.

    list[list[Sample]] stays as is; deeper nesting (e.g. list[list[list[Sample]]]) is flattened down to
    its innermost lists of samples, in order; a flat list[Sample] is grouped by group_index (first
    appearance order). Anything else (None, a dict, mixed samples and lists, empty groups) is refused.
    """
    if not isinstance(result, (list, tuple)):
        raise RolloutResultError(f"{source} returned {type(result).__name__}; it must return list[list[Sample]] "
                                 "(groups of samples) or list[Sample]")
    if result and all(isinstance(x, Sample) for x in result):
        by_group: dict[int, list[Sample]] = {}
        for s in result:
            by_group.setdefault(s.group_index, []).append(s)
        return list(by_group.values())
    groups: list[list[Sample]] = []
    _collect_groups(result, groups, source, path="result")
    return groups


@dataclass(frozen=True)
class RolloutOutput:
    """A rollout function's batch (a RolloutBatch, or groups of samples) and its stats (metrics, JSON-able)."""
    batch: Any
    stats: dict = field(default_factory=dict)


def to_rollout_output(result: Any, source: str = "the rollout function") -> RolloutOutput:
    """Whatever a rollout function returned -> RolloutOutput with a RolloutBatch (see flatten_rollout)."""
    stats = {}
    if isinstance(result, RolloutOutput):
        result, stats = result.batch, dict(result.stats)
    if isinstance(result, RolloutBatch):
        return RolloutOutput(result, stats)
    groups = flatten_rollout(result, source)
    return RolloutOutput(RolloutBatch.from_samples(groups, sft=is_sft_batch(groups)), stats)


def _collect_groups(node: Any, out: list[list[Sample]], source: str, path: str) -> None:
    if not isinstance(node, (list, tuple)):
        raise RolloutResultError(f"{source} returned {type(node).__name__} at {path}; expected a list of samples "
                                 "or a list of such lists")
    if not node:
        raise RolloutResultError(f"{source} returned an empty list at {path}; a group needs at least one sample")
    kinds = {isinstance(x, Sample) for x in node}
    if kinds == {True}:
        out.append(list(node))
        return
    if kinds == {True, False}:
        raise RolloutResultError(f"{source} mixes samples and lists at {path}; return list[list[Sample]]")
    for i, child in enumerate(node):
        _collect_groups(child, out, source, f"{path}[{i}]")


__all__ = ["ImportPathError", "RolloutOutput", "RolloutResultError", "flatten_rollout", "load_rollout_function",
           "to_rollout_output"]
