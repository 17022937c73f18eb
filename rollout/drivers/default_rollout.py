"""The default rollout function (`spillover.rollout.drivers.default_rollout.generate_rollout`, the seed signature) and
generate_training_batch: partial rollout over the run's dock with the driver loop (rollout/drivers/rounds.py; with
rollout.env_path set, its tool hooks, rollout/drivers/tool_turns.py), then the training batch; evaluation generates
each eval set greedily (rollout/drivers/evaluation.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from ...infra.config.rollout import RolloutConfig
from ..dock.transfer_dock import TransferDock
from ..contracts.fleet import Fleet
from .requests import GenerationStats, SamplingSettings
from .rounds import DetachedRows, OnRound, RoundHooks, generate_rounds
from .tool_turns import ToolTurns, turn_metrics
from ..contracts.rollout_function import RolloutOutput
from ..stop_strings import Decode
from .evaluation import run_eval


def generate_training_batch(dock: TransferDock, fleet: Fleet, rollout_cfg: RolloutConfig,
                            stop_token_ids: Sequence[int], weight_version: int, drain: bool,
                            on_round: OnRound | None = None, seed: int | None = None,
                            hooks: RoundHooks | None = None, detached: DetachedRows | None = None,
                            decode: Decode | None = None) -> GenerationStats:
    """Generate until the dock is ready (rollout.mode's rounds, with the hooks given), then choose the training batch
    once. seed: model.seed, used with rollout.deterministic_sampling; detached: the run's DetachedRows
    (rollout.overlap); decode: the tokenizer's (rollout.stop strings are matched across partial-rollout cuts)."""
    sampling = SamplingSettings.from_rollout(rollout_cfg, stop_token_ids, seed)
    stats = generate_rounds(dock, fleet, rollout_cfg, sampling, weight_version, drain, on_round, hooks, detached,
                            decode)
    dock.select_batch()
    return stats


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The default rollout function (seed signature): partial rollout over the run's dock.

    args: the RunConfig; data_source: a spillover.rollout.context.RolloutContext. Training: RolloutOutput with the GBS
    groups the dock chose, as columns, and the generation stats (with rollout.env_path, the tool and turn metrics
    too). evaluation=True: every data set of data.eval_paths, generated greedily once per prompt -> {key: groups}.
    """
    if evaluation:
        return _evaluate(args, data_source)
    dock = data_source.dock
    drain = rollout_id == args.schedule.num_iterations - 1
    tools = _tool_turns(args, rollout_id, data_source) if args.rollout.env_path else None
    stats = generate_training_batch(dock, data_source.fleet, args.rollout, data_source.stop_token_ids,
                                    data_source.weight_version, drain, data_source.on_round, args.model.seed, tools,
                                    data_source.detached, data_source.tokenizer.decode)
    batch = dock.rollout_batch()
    if tools is None:
        return RolloutOutput(batch, stats.as_dict())
    return RolloutOutput(batch, {**stats.as_dict(), **tools.stats.as_dict(), **turn_metrics(batch)})


def _tool_turns(args, rollout_id: int, data_source) -> ToolTurns:
    """The tool hooks with data_source.envs (a spillover.rollout.tools.env_pool.EnvPool that lives as long as the
    run); its calls run on the engine's event loop."""
    if data_source.envs is None:
        raise ValueError("rollout.env_path is set but the rollout context has no env pool (RolloutContext.envs)")
    return ToolTurns(data_source.dock, data_source.weight_version, args.rollout, data_source.envs,
                     data_source.tokenizer, data_source.fleet.loop, rollout_id)


def _evaluate(args, data_source) -> dict:
    return run_eval(data_source.eval_sets, data_source.fleet, data_source.reward_fn,
                    tokenizer=data_source.tokenizer, stop_token_ids=data_source.stop_token_ids,
                    max_new_tokens=args.rollout.max_tokens, max_model_len=args.rollout.max_model_len,
                    temperature=0.0, top_p=1.0, top_k=-1,  # greedy: eval measures the policy's best guess
                    reward_fn_path=args.grpo.reward_function_path, stop=args.rollout.stop)
