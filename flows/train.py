"""The GRPO training flow: one Prefect subflow per iteration, its tasks reading like the algorithm.

Each task takes the parts it needs and returns a small immutable result (tasks/results.py) that the
iteration passes on as a local variable; the weight version travels the same way, from iteration to iteration.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, ParamSpec, TypeVar

import numpy as np
from prefect import Task, flow
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.utilities.annotations import quote

from .parts import RunParts
from ..infra.tracking.report import build_report
from .run_lock import acquire_run_lock
from .setup import Run, build_run, shutdown_run
from ..infra.config.run_config import RunConfig
from ..infra.gc_pauses import long_lived_heap_frozen
from ..infra.hooks import hook_point
from ..infra.tracking.prefect_artifacts import current_run_ids
from ..infra.tracking.run_tracker import RunTracker
from ..tasks.run_state import open_and_check, restore_weights, rewind_metrics, save_run_checkpoint
from ..tasks.clear import clear_and_age_sort
from ..tasks.generate import generate_until_ready
from ..tasks.logprob import compute_old_logprob, compute_ref_logprob
from ..tasks.prompts import load_prompts
from ..tasks.results import Evaluated, iteration_row, iteration_scalars
from ..tasks.reward import compute_reward
from ..tasks.update import update

log = logging.getLogger("spillover")
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class IterationOutcome:
    row: dict                  # the metrics.jsonl row
    scalars: dict              # the same for wandb, under train/, rollout/, eval/, time/
    weight_version: int        # what the engines serve after this iteration
    response_lengths: np.ndarray  # of the trained samples (the report's length histogram)
    ages: np.ndarray
    flow_run_id: object = None


class StageClock:
    """The time each step of one iteration took, by step name (the metrics' task_s)."""

    def __init__(self, iteration: int):
        self.iteration, self.task_s = iteration, {}

    def timed(self, step: Callable[P, R], name: str | None = None) -> Callable[P, R]:
        """`step` (a Prefect task, named by its task name, or a plain function named by `name`) with the same
        arguments and result, and around each call: the fault hook at its start (infra/hooks.py, the kill -9 tests'
        points), its wall time under its name. Arguments go to Prefect tasks quoted: Prefect would otherwise walk
        every prompt and sample looking for futures."""
        is_task = isinstance(step, Task)
        label = name or step.name

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            hook_point(label, self.iteration)
            start = time.perf_counter()
            if is_task:
                args = tuple(_quoted(a) for a in args)
                kwargs = {key: _quoted(a) for key, a in kwargs.items()}
            out = step(*args, **kwargs)
            self.task_s[label] = time.perf_counter() - start
            return out
        return call


def _quoted(arg):
    return arg if isinstance(arg, (int, float, str, bool, type(None))) else quote(arg)


def run_iteration(run: Run, iteration: int, version: int, wandb_run_id: str | None = None, on_round=None,
                  store=None) -> IterationOutcome:
    """One GRPO iteration; `version` is the weight version the engines serve at its start."""
    cfg, clock, start = run.cfg, StageClock(iteration), time.perf_counter()
    timed = clock.timed  # each step: the fault hook at its start, its time in the metrics (task_s)
    loaded = timed(load_prompts)(run.dock, run.cursor, run.prompts, iteration, cfg.schedule.num_iterations)
    rollout = timed(generate_until_ready)(run.controller, run.context.for_iteration(version, on_round), iteration)
    scored = timed(compute_reward)(rollout, run.reward)
    stages = [loaded, rollout, scored]
    if not cfg.schedule.debug_rollout_only:  # rollout only: no learner, so no logprobs and no update
        ref = timed(compute_ref_logprob)(run.policy, run.ref, scored, cfg.grpo.kl_coef)
        old = timed(compute_old_logprob)(run.policy, scored, version, cfg.grpo.skip_old_logprob)
        updated = timed(update)(run.policy, run.fleet, scored, old, ref)
        version = updated.weight_version
        stages += [ref, old, updated]
    interval = cfg.schedule.eval_interval
    if interval and (iteration + 1) % interval == 0:
        metrics = timed(run.controller.eval, "eval")(iteration, run.context.for_iteration(version), version)
        stages.append(Evaluated(metrics=metrics))
    stages.append(timed(clear_and_age_sort)(run.dock, run.cursor, rollout, cfg.rollout.overlap))
    row = iteration_row(iteration, stages, clock.task_s)  # also the checkpoint's copy (restored on resume)
    saved = timed(save_run_checkpoint)(store if run.policy is not None else None, run.policy, run.dock, run.cursor,
                                       cfg, iteration, version, row, wandb_run_id)  # no learner: no checkpoint
    stages.append(saved)
    row = {**row, **saved.metrics, "task_s": dict(clock.task_s), "time_s": time.perf_counter() - start}
    return IterationOutcome(row, iteration_scalars(stages, clock.task_s) | {"time/iteration_s": row["time_s"]},
                            version, rollout.batch.response_lengths, rollout.batch.ages)


def make_iteration_flow(run: Run, store=None, wandb_run_id: str | None = None, on_round=None):
    """A subflow bound to this run; its parameters are the iteration and the weight version at its start,
    so the UI shows `iteration-0007` and what it started from."""
    @flow(name="grpo-iteration", flow_run_name="iteration-{iteration:04d}", validate_parameters=False)
    def grpo_iteration(iteration: int, weight_version: int) -> IterationOutcome:
        outcome = run_iteration(run, iteration, weight_version, wandb_run_id, on_round, store)
        return replace(outcome, flow_run_id=current_run_ids()[1])
    return grpo_iteration


@flow(name="grpo-train", log_prints=True)
def grpo_train(config: RunConfig, resume: bool = False, parts: RunParts | None = None) -> dict:
    """Train `config.schedule.num_iterations` GRPO iterations with partial rollout; returns the run summary.

    resume=True continues from the newest verified checkpoint of the run (partial responses included).
    parts: where the run's engines and learner groups come from (flows/parts.py; None: started for this run). A flow
    parameter, not state the flow looks up, so that what a run borrows is visible at its call (the test suite lends
    its kept parts this way: tests/fixtures_warm.py); Prefect records it only by its type name (RunParts).
    """
    run, tracker, lock = None, None, None
    try:
        lock = acquire_run_lock(config)  # a second run on this run_dir / checkpoint location stops here
        store, saved = open_and_check(config, resume)
        run = build_run(config, saved, parts)
        first, version = 0, 0
        if saved is not None:
            version = restore_weights(run.policy, run.fleet, saved)
            first = int(saved.meta["next_iteration"])
            rewind_metrics(run.run_dir, first, saved.meta.get("metrics"))
        tracker = RunTracker(run.run_dir, config.tracking, run_config=config,
                             resume_wandb_id=saved.meta.get("wandb_run_id") if saved else None)
        tracker.start(resumed=saved is not None, first_iteration=first)
        iteration_flow = make_iteration_flow(run, store, tracker.wandb_run_id, tracker.on_round)
        # Heartbeats stay on for this outer flow (crash detection); per-iteration subflows skip them,
        # which saves ~1 s of fixed cost per iteration.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), long_lived_heap_frozen():
            loop_start = time.perf_counter()  # after the one-time collection that freezing starts with
            for iteration in range(first, config.schedule.num_iterations):
                start = time.perf_counter()
                outcome = iteration_flow(iteration, version)
                version = outcome.weight_version
                wall = time.perf_counter() - start  # incl. the subflow's own cost
                tracker.on_iteration({**outcome.row, "iteration_wall_s": wall},
                                     {**outcome.scalars, "time/iteration_wall_s": wall},
                                     outcome.response_lengths, outcome.ages, outcome.flow_run_id)
                tracker.settle()
        return tracker.finish(run.baseline, loop_wall_s=time.perf_counter() - loop_start,
                              report=build_report if config.tracking.report else None)
    finally:
        if tracker is not None:
            tracker.close()
        failure = sys.exc_info()[1]  # a refused input (ValueError: exit 2) leaves every part idle and sound
        shutdown_run(run, keep_parts=failure is None or isinstance(failure, ValueError))
        if lock is not None:
            lock.release()
