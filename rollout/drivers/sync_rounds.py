"""Sync partial rollout: rounds of max_tokens // max_split new tokens per row, until the dock is ready.

With max_split = 1 a round generates whole responses: plain GRPO. The engine is any spillover.rollout.drivers.requests.Generator.
"""
from __future__ import annotations

import time
from typing import Callable

from spillover.rollout.drivers.dispatch import DispatchPlanner
from spillover.rollout.drivers.requests import (GenerationStats, Generator, SamplingSettings, build_requests, parse_responses,
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
    planner = DispatchPlanner.from_config(rollout_cfg, engine, weight_version, drain)
    try:
        while not dock.update_ready():
            _sync_round(dock, engine, planner, rows_per_round, round_tokens, sampling, weight_version, stats)
            if on_round:
                on_round({"round": stats.rounds, "ready_groups": stats.ready_groups,
                          "target_groups": rollout_cfg.global_batch_size, "tokens": stats.tokens_generated,
                          "elapsed_s": time.perf_counter() - start})
    finally:
        planner.release_held(dock)
    stats.time_s = time.perf_counter() - start
    return stats


def _sync_round(dock, engine: Generator, planner: DispatchPlanner, rows_per_round: int, round_tokens: int,
                sampling: SamplingSettings, weight_version: int, stats: GenerationStats) -> None:
    rows, engines = planner.next_rows(dock, limit=rows_per_round)
    inputs, max_new = dock.generation_inputs(rows, round_tokens)
    requests = planner.route(build_requests(inputs, max_new, sampling, request_seeds(dock, rows, sampling)),
                             engines)
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
