"""The default rollout function (`spillover.rollout.drivers.default_rollout.generate_rollout`, the seed signature) and generate_batch:
partial rollout over the run's dock with the mode's driver (rollout/drivers/sync_rounds.py, rollout/drivers/async_stream.py; with
rollout.env_path set, the multi-turn driver rollout/drivers/multi_turn.py in either mode), then the training batch;
evaluation generates each eval set greedily (rollout/scoring/evaluation.py).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from spillover.rollout.scoring.evaluation import run_eval
from spillover.rollout.functions import RolloutOutput
from spillover.rollout.drivers.multi_turn import generate_until_ready_multi_turn
from spillover.rollout.drivers.async_stream import generate_until_ready_async
from spillover.rollout.drivers.sync_rounds import generate_until_ready_sync
from spillover.rollout.drivers.requests import GenerationStats, Generator, SamplingSettings


def generate_batch(dock, engine: Generator, rollout_cfg, stop_token_ids, weight_version: int, drain: bool,
                   on_round: Callable[[dict], None] | None = None, seed: int | None = None) -> GenerationStats:
    """Generate until the dock is ready (sync or async mode), then choose the training batch once.
    seed: model.seed, used with rollout.deterministic_sampling."""
    sampling = SamplingSettings.from_rollout(rollout_cfg, stop_token_ids, seed)
    driver = generate_until_ready_async if rollout_cfg.mode == "async" else generate_until_ready_sync
    stats = driver(dock, engine, rollout_cfg, sampling, weight_version, drain, on_round)
    dock.select_batch()
    return stats


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The default rollout function (seed signature): partial rollout over the run's dock.

    args: the RunConfig; data_source: a spillover.rollout.context.RolloutContext. Training: RolloutOutput with the GBS
    groups the dock chose, as columns, and the generation stats. evaluation=True: every data set of
    data.eval_paths, generated greedily once per prompt -> {key: groups}.
    """
    if evaluation:
        return _evaluate(args, data_source)
    dock = data_source.dock
    drain = rollout_id == args.schedule.num_iterations - 1
    if args.rollout.env_path:
        return generate_multi_turn_batch(args, rollout_id, data_source, drain)
    stats = generate_batch(dock, data_source.engine, args.rollout, data_source.stop_token_ids,
                           data_source.weight_version, drain, data_source.on_round, args.model.seed)
    return RolloutOutput(dock.rollout_batch(), stats.as_dict())


def _evaluate(args, data_source) -> dict:
    return run_eval(data_source.eval_sets, data_source.engine.generate, data_source.reward_fn,
                    tokenizer=data_source.tokenizer, stop_token_ids=data_source.stop_token_ids,
                    max_new_tokens=args.rollout.max_tokens, max_model_len=args.rollout.max_model_len,
                    temperature=0.0, top_p=1.0, top_k=-1,  # greedy: eval measures the policy's best guess
                    reward_fn_path=args.grpo.reward_function_path, stop=args.rollout.stop)


def generate_multi_turn_batch(args, rollout_id: int, data_source, drain: bool) -> RolloutOutput:
    """Multi-turn trajectories over the dock (rollout/drivers/multi_turn.py) with data_source.envs (a spillover.rollout.tools.env_pool.EnvPool
    that lives as long as the run), then the training batch and the tool metrics."""
    if getattr(data_source, "envs", None) is None:
        raise ValueError("rollout.env_path is set but the rollout context has no env pool (RolloutContext.envs)")
    dock, cfg = data_source.dock, args.rollout
    sampling = SamplingSettings.from_rollout(cfg, data_source.stop_token_ids, args.model.seed)
    stats, tools = generate_until_ready_multi_turn(dock, data_source.engine, cfg, sampling, data_source.weight_version,
                                                   drain, data_source.on_round, data_source.envs,
                                                   data_source.tokenizer, rollout_id)
    dock.select_batch()
    batch = dock.rollout_batch()
    return RolloutOutput(batch, {**stats.as_dict(), **tools.as_dict(), **turn_metrics(batch)})


def turn_metrics(batch) -> dict:
    """turns_mean / turns_max (model turns per trained trajectory: tool calls + 1) and tool_token_share (the trained
    response tokens that are tool output, loss mask 0)."""
    turns = (batch.turns if batch.turns is not None else np.zeros(len(batch), np.int32)) + 1
    tokens = len(batch.loss_mask)
    return {"turns_mean": float(turns.mean()) if len(turns) else 0.0,
            "turns_max": int(turns.max()) if len(turns) else 0,
            "tool_token_share": float((batch.loss_mask == 0).sum() / tokens) if tokens else 0.0}
