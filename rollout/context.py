"""RolloutContext: what a rollout or eval function gets as `data_source` (slime's signature
`fn(args, rollout_id, data_source, evaluation=False)`), and nothing more.

The long-lived parts (dock, fleet, tokenizer, prompts) are the run's; the weight version and the
progress callback are this iteration's, so the flow builds a new context per iteration (`for_iteration`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable

from .contracts.fleet import Fleet
from .drivers.rounds import DetachedRows
from .prompt_data import PromptCursor, PromptSet, read_prompt_file
from ..infra.data_files import data_file


class EvalSets:
    """The eval data sets of data.eval_paths, read once, on first use."""

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    @cached_property
    def sets(self) -> dict[str, PromptSet]:
        data, rollout = self.cfg.data, self.cfg.rollout
        max_prompt = rollout.max_model_len - rollout.max_tokens
        return {key: read_prompt_file(data_file(path, f"data.eval_paths.{key}", self.cfg), self.tokenizer, data,
                                      max_prompt)
                for key, path in data.eval_paths.items()}


@dataclass(frozen=True)
class RolloutContext:
    dock: Any                      # spillover.rollout.dock.transfer_dock.TransferDock (None when the rollout needs no dock)
    fleet: Fleet | None            # the engines (None: no generation, e.g. replayed data)
    tokenizer: Any
    prompts: PromptSet
    cursor: PromptCursor
    stop_token_ids: tuple[int, ...]
    reward_fn: Callable
    eval_data: EvalSets | None = None
    weight_version: int = 0
    on_round: Callable[[dict], None] | None = None
    envs: Any = None               # spillover.rollout.tools.env_pool.EnvPool with rollout.env_path set (lives as long as the run)
    detached: DetachedRows | None = None  # rollout.overlap: the requests left running between iterations (the run's)

    @property
    def eval_sets(self) -> dict[str, PromptSet]:
        return self.eval_data.sets if self.eval_data is not None else {}

    def for_iteration(self, weight_version: int, on_round=None) -> "RolloutContext":
        return replace(self, weight_version=int(weight_version), on_round=on_round)
