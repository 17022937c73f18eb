"""The GRPO training flow: one Prefect subflow per iteration, seven tasks inside, reading like the algorithm."""
from __future__ import annotations

import logging
import time

from prefect import flow
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from flows.run_lock import acquire_run_lock
from flows.setup import build_run, shutdown_run
from infra.config import RunConfig
from infra.faults import maybe_kill
from infra.gc_pauses import long_lived_heap_frozen
from infra.prefect_artifacts import current_run_ids
from infra.tracking import RunTracker
from tasks.checkpoint import open_and_check, restore, rewind_metrics
from tasks.clear import clear_and_age_sort
from tasks.generate import generate_until_ready
from tasks.logprob import compute_old_logprob, compute_ref_logprob
from tasks.prompts import load_prompts
from tasks.reward import compute_reward
from tasks.run_state import RunState
from tasks.update import update

log = logging.getLogger("spillover")


def _timed(it, name: str, task, *args, **kwargs):
    maybe_kill(name, it.iteration)
    start = time.perf_counter()
    out = task(*args, **kwargs)
    it.task_s[name] = time.perf_counter() - start
    return out


def run_iteration(run: RunState, iteration: int, on_round=None) -> dict:
    """One GRPO iteration as seven tasks; returns the iteration's metrics (small, JSON-able)."""
    it = run.start_iteration(iteration)
    start = time.perf_counter()
    it.metrics["loaded_groups"] = _timed(it, "load_prompts", load_prompts, run, iteration)
    it.metrics.update(_timed(it, "generate_until_ready", generate_until_ready, run, iteration, on_round))
    _timed(it, "compute_reward", compute_reward, run)
    _timed(it, "compute_ref_logprob", compute_ref_logprob, run)
    _timed(it, "compute_old_logprob", compute_old_logprob, run)
    if not run.cfg.schedule.debug_rollout_only:
        _timed(it, "update", update, run)
    interval = run.cfg.schedule.eval_interval
    if interval and (iteration + 1) % interval == 0:
        it.metrics.update(_timed(it, "eval", run.controller.eval, iteration, run, run.weight_version))
    _timed(it, "clear_and_age_sort", clear_and_age_sort, run)
    it.metrics["time_s"] = time.perf_counter() - start
    it.metrics["task_s"] = dict(it.task_s)
    return it.metrics


def make_iteration_flow(run: RunState, on_round=None):
    """A subflow bound to this run: its only parameter is the iteration, so the UI shows `iteration-0007`."""
    @flow(name="grpo-iteration", flow_run_name="iteration-{iteration:04d}", validate_parameters=False)
    def grpo_iteration(iteration: int) -> dict:
        metrics = run_iteration(run, iteration, on_round)
        run.current.flow_run_id = current_run_ids()[1]  # artifacts attach here without an API lookup
        return metrics
    return grpo_iteration


@flow(name="grpo-train", log_prints=True)
def grpo_train(config: RunConfig, resume: bool = False) -> dict:
    """Train `config.schedule.num_iterations` GRPO iterations with partial rollout; returns the run summary.

    resume=True continues from the newest verified checkpoint of the run (partial responses included).
    """
    run, tracker, lock = None, None, None
    try:
        lock = acquire_run_lock(config)  # a second run on this run_dir / checkpoint location stops here
        store, saved = open_and_check(config, resume)
        run = build_run(config)
        run.checkpoint_store = store
        first = 0
        if saved is not None:
            first = restore(run, saved)
            rewind_metrics(run.run_dir, first, saved.meta.get("metrics"))
        tracker = RunTracker(run.run_dir, config.tracking, run_config=config,
                             resume_wandb_id=saved.meta.get("wandb_run_id") if saved else None)
        tracker.start(resumed=saved is not None, first_iteration=first)
        run.wandb_run_id = tracker.wandb_run_id
        iteration_flow = make_iteration_flow(run, tracker.on_round)
        # Heartbeats stay on for this outer flow (crash detection); per-iteration subflows skip them,
        # which saves ~1 s of fixed cost per iteration.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), long_lived_heap_frozen():
            loop_start = time.perf_counter()  # after the one-time collection that freezing starts with
            for iteration in range(first, config.schedule.num_iterations):
                start = time.perf_counter()
                metrics = iteration_flow(iteration)
                metrics["iteration_wall_s"] = time.perf_counter() - start  # incl. the subflow's own cost
                tracker.on_iteration(metrics, samples=run.current.samples, flow_run_id=run.current.flow_run_id)
                tracker.settle()
        return tracker.finish(run.baseline, loop_wall_s=time.perf_counter() - loop_start)
    finally:
        if tracker is not None:
            tracker.close()
        shutdown_run(run)
        if lock is not None:
            lock.release()
