"""Partial-rollout generation over the dock: the sync driver (rounds of max_tokens // max_split).

The engine side is anything with `generate(requests) -> list[response]` speaking SGLang's /generate
shapes (RolloutManager through the router, or a simulated engine).
"""
from __future__ import annotations

import time
from typing import Callable

from rollout.evaluation import run_eval
from rollout.functions import RolloutOutput
from rollout.partial_async import generate_until_ready_async
from rollout.requests import (GenerationStats, Generator, SamplingSettings, build_requests, parse_responses,
                              request_seeds)


def generate_until_ready_sync(dock, engine: Generator, rollout_cfg, sampling: SamplingSettings,
                              weight_version: int, drain: bool = False,
                              on_round: Callable[[dict], None] | None = None) -> GenerationStats:
    """Rounds of max_tokens // max_split new tokens per row until >= GBS groups are ready (drain: all rows).

    Each round takes up to (GBS + over_sampling_groups) x n rows from the dock (carried-over rows first, oldest
    first): the over-sampled groups go out from the first round (APRIL), not only as earlier rows finish.
    With max_split = 1 a round generates whole responses: plain GRPO.
    """
    round_tokens = rollout_cfg.max_tokens // rollout_cfg.max_split
    rows_per_round = ((rollout_cfg.global_batch_size + rollout_cfg.over_sampling_groups)
                      * rollout_cfg.n_samples_per_prompt)
    dock.set_drain(drain)
    stats = GenerationStats()
    start = time.perf_counter()
    while not dock.update_ready():
        rows = dock.take_rows(limit=rows_per_round)
        if len(rows) == 0:
            raise RuntimeError(f"generation cannot finish: no row left to generate but only "
                               f"{dock.ready_group_count()} groups are ready (need {rollout_cfg.global_batch_size})")
        inputs, max_new = dock.generation_inputs(rows, round_tokens)
        requests = build_requests(inputs, max_new, sampling, request_seeds(dock, rows, sampling))
        try:
            engine_start = time.perf_counter()
            responses = engine.generate(requests)
            stats.engine_s += time.perf_counter() - engine_start
            tokens, logprobs, stopped, version = parse_responses(responses, weight_version)
        except BaseException:
            dock.release(rows)  # the rows go back untouched: nothing half-written
            raise
        dock.put_generation(rows, tokens, logprobs, version, stopped)
        stats.rounds += 1
        stats.requests += len(rows)
        stats.tokens_generated += sum(len(t) for t in tokens)
        stats.ready_groups = dock.ready_group_count()
        if on_round:
            on_round({"round": stats.rounds, "ready_groups": stats.ready_groups,
                      "target_groups": rollout_cfg.global_batch_size, "tokens": stats.tokens_generated,
                      "elapsed_s": time.perf_counter() - start})
    stats.time_s = time.perf_counter() - start
    return stats


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

    args: the RunConfig; data_source: a rollout.context.RolloutContext. Training: RolloutOutput with the GBS
    groups the dock chose, as columns, and the generation stats. evaluation=True: every data set of
    data.eval_paths, generated greedily once per prompt -> {key: groups}.
    """
    if evaluation:
        return _evaluate(args, data_source)
    dock = data_source.dock
    drain = rollout_id == args.schedule.num_iterations - 1
    stats = generate_batch(dock, data_source.engine, args.rollout, data_source.stop_token_ids,
                           data_source.weight_version, drain, data_source.on_round, args.model.seed)
    return RolloutOutput(dock.rollout_batch(), stats.as_dict())


def _evaluate(args, data_source) -> dict:
    return run_eval(data_source.eval_sets, data_source.engine.generate, data_source.reward_fn,
                    tokenizer=data_source.tokenizer, stop_token_ids=data_source.stop_token_ids,
                    max_new_tokens=args.rollout.max_tokens, max_model_len=args.rollout.max_model_len,
                    temperature=0.0, top_p=1.0, top_k=-1,  # greedy: eval measures the policy's best guess
                    reward_fn_path=args.grpo.reward_function_path, stop=args.rollout.stop)
