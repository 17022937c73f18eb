"""Async partial rollout: every incomplete row goes to the engines at once; each response is written to
the dock as it arrives; once the dock is ready (>= GBS groups, rows at max age finished) every engine
aborts, and the partial tokens that come back stay in the dock for the next iteration.

The stop check runs on every arriving response (finer than MindSpeed's "every 20 engine steps": a
vectorised readiness check costs microseconds); the callback that finds the dock ready returns True, which
stops the round (see spillover.rollout.drivers.requests.Generator): the engine aborts and `generate` returns once it is idle.
Callbacks run one at a time (on the manager's loop) while the calling thread waits in `generate`, and the
rows left unanswered go back after it returns, so the dock is only ever touched by one thread at a time.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from spillover.rollout.drivers.dispatch import DispatchPlanner
from spillover.rollout.drivers.requests import (GenerationStats, Generator, SamplingSettings, build_requests, parse_responses,
                              request_seeds)


class _AsyncRound:
    def __init__(self, dock, rows: np.ndarray, weight_version: int, stats: GenerationStats,
                 on_round: Callable[[dict], None] | None, target_groups: int, start: float):
        self.dock, self.rows = dock, rows
        self.weight_version, self.stats, self.on_round = weight_version, stats, on_round
        self.target_groups, self.start = target_groups, start
        self.written = np.zeros(len(rows), dtype=bool)
        self.stopping = False
        self.last_report = 0.0

    def on_result(self, index: int, response: dict) -> bool:
        """Write the answer into the dock; True (stop the round) once the dock is ready."""
        if self.written[index]:
            return False  # an engine restart may deliver a retried request twice: keep the first
        tokens, logprobs, stopped, version = parse_responses([response], self.weight_version)
        self.dock.put_generation(self.rows[index:index + 1], tokens, logprobs, version, stopped)
        self.written[index] = True
        self.stats.tokens_generated += len(tokens[0])
        stop = not self.stopping and bool(self.dock.update_ready())
        self.stopping |= stop
        self._report()
        return stop

    def _report(self) -> None:
        now = time.perf_counter()
        if self.on_round and (now - self.last_report > 0.5 or self.stopping):
            self.last_report = now
            self.on_round({"round": self.stats.rounds, "ready_groups": self.dock.ready_group_count(),
                           "target_groups": self.target_groups, "tokens": self.stats.tokens_generated,
                           "elapsed_s": now - self.start})

    def release_unwritten(self) -> None:
        left = self.rows[~self.written]
        self.written[:] = True
        if len(left):
            self.dock.release(left)


def generate_until_ready_async(dock, engine: Generator, rollout_cfg, sampling: SamplingSettings,
                               weight_version: int, drain: bool = False,
                               on_round: Callable[[dict], None] | None = None) -> GenerationStats:
    """Dispatch all incomplete rows with their whole remaining budget; abort once the dock is ready."""
    dock.set_drain(drain)
    stats = GenerationStats()
    start = time.perf_counter()
    planner = DispatchPlanner.from_config(rollout_cfg, engine, weight_version, drain)
    try:
        while not dock.update_ready():
            rows, engines = planner.next_rows(dock)
            inputs, max_new = dock.generation_inputs(rows, None)
            stats.rounds += 1
            stats.requests += len(rows)
            round_ = _AsyncRound(dock, rows, weight_version, stats, on_round, rollout_cfg.global_batch_size, start)
            requests = planner.route(build_requests(inputs, max_new, sampling, request_seeds(dock, rows, sampling)),
                                     engines)
            engine_start = time.perf_counter()
            try:
                engine.generate(requests, on_result=round_.on_result)
            finally:
                stats.engine_s += time.perf_counter() - engine_start
                round_.release_unwritten()  # rows whose answer never came go back untouched
    finally:
        planner.release_held(dock)
    stats.ready_groups = dock.ready_group_count()
    stats.time_s = time.perf_counter() - start
    return stats
