"""The driver's side of rollout.scheduling: order the rows of a round, pick their engines, hold tail rows back.

    planner = DispatchPlanner.from_config(rollout_cfg, fleet, weight_version, drain)
    rows, engines = planner.plan(dock, dock.take_rows(...))   # engines: int64[k] or None (the router chooses)
    jobs = planner.route(build_requests(...), engines)         # GenerateJobs, pinned where an engine was chosen
    planner.release_held(dock)                                 # in a `finally`: held rows go back untouched

Tail rows (tail batching) stay marked in flight while they are held, so take_rows does not hand them out again
in the same generate call; when a round finds nothing else to generate they are dispatched after all, so holding
can never stall a driver. Outside length_aware scheduling the planner passes rows through unchanged.
"""
from __future__ import annotations

import numpy as np

from ..contracts.fleet import Fleet
from ..sglang.protocol import GenerateJob, GenerateRequest
from .scheduling import plan_dispatch


class DispatchPlanner:
    def __init__(self, scheduling: str = "fifo", num_engines: int = 1, tail_factor: float = 0.0,
                 long_round: bool = True, tail_engines: int = 0, start_order: str = "oldest",
                 fresh_limit: int | None = None, start_cutoff: bool = False):
        self.scheduling, self.num_engines, self.tail_engines = scheduling, num_engines, tail_engines
        self.start_order = start_order
        self.fresh_left = fresh_limit  # fresh groups this generate call may still start (None: no limit)
        self.start_cutoff = start_cutoff
        self.tail_factor, self.long_round = tail_factor, long_round
        self.held = np.zeros(0, dtype=np.int64)

    @classmethod
    def from_config(cls, rollout_cfg, fleet: Fleet, weight_version: int, drain: bool) -> "DispatchPlanner":
        """Rows are pinned to the fleet's num_engines engines (1: no pinning, rows are only ordered)."""
        scheduling = rollout_cfg.scheduling
        every = rollout_cfg.tail_round_every
        long_round = drain or (int(weight_version) + 1) % every == 0
        return cls(scheduling, max(1, int(fleet.num_engines)), rollout_cfg.tail_factor, long_round,
                   rollout_cfg.tail_engines, rollout_cfg.start_order, rollout_cfg.start_groups_per_step,
                   rollout_cfg.overlap and rollout_cfg.start_cutoff)

    def plan(self, dock, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """In-flight rows from take_rows -> (rows to send now, in order; engine per row or None)."""
        rows, engines, aside = plan_dispatch(dock, rows, self.scheduling, self.num_engines, self.tail_factor,
                                             self.long_round or len(self.held) > 0 or self.tail_engines > 0,
                                             self.tail_engines, self.start_order, self.fresh_left)
        if len(aside) and len(rows) == 0:  # nothing else to do: the tail (or the paced groups) goes now
            return self.plan_all(dock, aside)
        self.held = np.concatenate([self.held, aside])
        self.count_fresh(dock, rows)
        return rows, engines

    def count_fresh(self, dock, rows: np.ndarray) -> None:
        """Start pacing: the fresh groups among `rows` (about to be sent) use up this call's allowance."""
        if self.fresh_left is not None and len(rows):
            fresh = np.unique(rows[~dock.started_groups()[rows // dock.n]] // dock.n)
            self.fresh_left = max(0, self.fresh_left - len(fresh))

    def plan_all(self, dock, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        rows, engines, _ = plan_dispatch(dock, rows, self.scheduling, self.num_engines, self.tail_factor, True,
                                         self.tail_engines, self.start_order)
        self.count_fresh(dock, rows)
        return rows, engines

    def take_held(self) -> np.ndarray:
        """The held rows (still in flight), for a round that found nothing else to send."""
        held, self.held = self.held, np.zeros(0, dtype=np.int64)
        return held

    @staticmethod
    def route(requests: list[GenerateRequest], engines: np.ndarray | None,
              cutoff_groups: np.ndarray | None = None) -> list[GenerateJob]:
        """cutoff_groups[k] (rollout.start_cutoff; -1: none): request k's group, which must have started when its
        detached round stops, else the request waits for the next step unstarted."""
        pins = [None] * len(requests) if engines is None else engines.tolist()
        groups = [None] * len(requests) if cutoff_groups is None else [g if g >= 0 else None
                                                                        for g in cutoff_groups.tolist()]
        return [GenerateJob(request, engine, group) for request, engine, group in zip(requests, pins, groups)]

    def cutoff_groups(self, dock, rows: np.ndarray) -> np.ndarray | None:
        """rollout.start_cutoff: int64[k], each row's group slot where the group has not started, else -1 (None:
        off)."""
        if not self.start_cutoff:
            return None
        groups = np.asarray(rows, dtype=np.int64) // dock.n
        return np.where(dock.started_groups()[groups], -1, groups)

    def release_held(self, dock) -> None:
        if len(self.held):
            dock.release(self.take_held())

    def next_rows(self, dock, limit: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """A round's rows and engines: up to `limit` rows the dock hands out, planned; when it has none left,
        the rows held for the long round (none at all: nothing can generate now)."""
        rows = dock.take_rows(limit=limit)
        return self.plan(dock, rows) if len(rows) else self.plan_all(dock, self.take_held())
