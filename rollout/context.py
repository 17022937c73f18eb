"""RolloutContext: what a rollout or eval function gets as `data_source` (slime's signature
`fn(args, rollout_id, data_source, evaluation=False)`), and nothing more.

The long-lived parts (dock, fleet, tokenizer, prompts) are the run's; the weight version and the
progress callback are this iteration's, so the flow builds a new context per iteration (`for_iteration`).
`build_context` makes the run's: the dock and prompt cursor (new, or as a checkpoint left them), the tool env pool,
the eval sets and the detached rows; the fleet joins once it has started (`with_fleet`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

from .contracts.fleet import Fleet
from .drivers.rounds import DetachedRows
from .prompt_data import PromptCursor, PromptSet, read_prompt_file
from ..infra.config.parsing import ConfigError
from ..infra.data_files import data_file
from .dock.transfer_dock import TransferDock
from .dock.turns import enable as enable_tool_turns
from .tools.env_pool import EnvPool

if TYPE_CHECKING:
    from ..infra.config.run_config import RunConfig
    from ..infra.storage.checkpoint import CheckpointState


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
    dock: TransferDock | None      # None when the rollout needs no dock
    fleet: Fleet | None            # the engines (None: no generation, e.g. replayed data)
    tokenizer: Any
    prompts: PromptSet
    cursor: PromptCursor
    stop_token_ids: tuple[int, ...]
    reward_fn: Callable
    eval_data: EvalSets | None = None
    weight_version: int = 0
    on_round: Callable[[dict], None] | None = None
    envs: EnvPool | None = None    # rollout.env_path's tool envs (live as long as the run)
    detached: DetachedRows | None = None  # rollout.overlap: the requests left running between iterations (the run's)

    @property
    def eval_sets(self) -> dict[str, PromptSet]:
        return self.eval_data.sets if self.eval_data is not None else {}

    def for_iteration(self, weight_version: int, on_round=None) -> "RolloutContext":
        return replace(self, weight_version=int(weight_version), on_round=on_round)

    def with_fleet(self, fleet: Fleet | None) -> "RolloutContext":
        return replace(self, fleet=fleet)

    def close(self) -> None:
        """What the context holds beyond the run: the tool env pool."""
        if self.envs is not None:
            self.envs.close()


def restore_dock_and_cursor(state: CheckpointState) -> tuple[TransferDock, PromptCursor]:
    """The dock (partial responses included) and the prompt cursor as the checkpoint left them."""
    dock = TransferDock.restore(state.arrays["dock"], state.meta["dock"], f"{state.url}/meta.json")
    return dock, PromptCursor.from_state(state.meta["cursor"])


def build_context(cfg: RunConfig, tokenizer, prompts: PromptSet, stop_token_ids: tuple[int, ...], reward_fn: Callable,
                  saved: CheckpointState | None = None) -> RolloutContext:
    """The run's rollout parts, without a fleet yet: the dock and cursor new, or restored from `saved` under this
    config's rules (the staleness rule; tool turns on a checkpoint written without them: every token so far is a
    policy token), the tool env pool (rollout.env_path), the eval sets (read on first use) and the detached rows
    (rollout.overlap)."""
    rollout = cfg.rollout
    if saved is not None:
        dock, cursor = restore_dock_and_cursor(saved)
        if cursor.num_prompts != len(prompts):
            raise ConfigError(f"data.prompts_path: the checkpoint's data set had {cursor.num_prompts} prompts, "
                              f"{len(prompts)} are loaded now; resume with the run's own data, or start a new run_dir")
        if dock.multi_turn and not rollout.env_path:  # its rows waiting on a tool call would wait for ever
            raise ConfigError("rollout.env_path: the checkpoint holds multi-turn rollouts with tool calls; resume "
                              "with the run's rollout.env_path")
        dock.require_max_age_all_finished = rollout.require_max_age_all_finished
        if rollout.env_path:
            enable_tool_turns(dock)
    else:
        dock = TransferDock.from_config(rollout, stop_token_ids)
        cursor = PromptCursor(len(prompts), seed=cfg.model.seed, shuffle=cfg.data.shuffle)
    envs = EnvPool.from_config(rollout) if rollout.env_path else None
    return RolloutContext(dock=dock, fleet=None, tokenizer=tokenizer, prompts=prompts, cursor=cursor,
                          stop_token_ids=tuple(stop_token_ids), reward_fn=reward_fn,
                          eval_data=EvalSets(cfg, tokenizer) if cfg.data.eval_paths else None, envs=envs,
                          detached=DetachedRows() if rollout.overlap else None)
