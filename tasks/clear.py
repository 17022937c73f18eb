"""clear/age-sort: trained groups leave the dock; the rest age by one and are ordered oldest first.
Then the iteration's state goes to storage (every storage.checkpoint_interval iterations)."""
from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NONE

from tasks.checkpoint import save_run_checkpoint, should_checkpoint


def clear_dock(run) -> dict:
    it = run.current
    if not run.controller.uses_dock:  # custom, SFT or replayed samples never entered the dock
        ids = sorted({s.group_index for g in it.samples for s in g})
        it.metrics.update(trained_group_ids=ids, trained_stream_ids=ids, carried_rows=0, partial_rows=0)
        return {"trained_groups": len(ids)}
    trained = run.dock.batch_group_ids()
    it.metrics["trained_group_ids"] = [int(i) for i in run.cursor.dataset_indices(trained)]
    it.metrics["trained_stream_ids"] = [int(i) for i in trained]
    stats = run.dock.clear()
    it.metrics["carried_rows"] = int(stats.get("carried_rows", 0))
    it.metrics["partial_rows"] = int(stats.get("partial_rows", 0))
    it.metrics["age_histogram"] = stats.get("age_histogram", {})
    return stats


@task(name="clear_and_age_sort", cache_policy=NONE)
def clear_and_age_sort(run) -> dict:
    it = run.current
    stats = clear_dock(run)
    if run.checkpoint_store is not None and should_checkpoint(run.cfg, it.iteration):
        it.metrics["time_s"] = time.perf_counter() - it.started
        start = time.perf_counter()
        stats["checkpoint"] = save_run_checkpoint(run, run.checkpoint_store, it.iteration, it.metrics,
                                                  run.wandb_run_id)
        it.metrics["checkpoint_s"] = time.perf_counter() - start
    return stats
