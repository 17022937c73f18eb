"""clear/age-sort: trained groups leave the dock; the rest age by one and are ordered oldest first."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE


@task(name="clear_and_age_sort", cache_policy=NONE)
def clear_and_age_sort(run) -> dict:
    it = run.current
    trained = run.cursor.dataset_indices(run.dock.batch_group_ids())
    it.metrics["trained_group_ids"] = [int(i) for i in trained]
    it.metrics["trained_stream_ids"] = [int(i) for i in run.dock.batch_group_ids()]
    stats = run.dock.clear()
    it.metrics["carried_rows"] = int(stats.get("carried_rows", 0))
    it.metrics["partial_rows"] = int(stats.get("partial_rows", 0))
    it.metrics["age_histogram"] = stats.get("age_histogram", {})
    return stats
