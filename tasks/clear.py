"""clear/age-sort: trained groups leave the dock; the rest age by one and are ordered oldest first."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from ..rollout.dock.length_history import PREDICTION_KEYS
from ..rollout.dock.transfer_dock import TransferDock
from ..rollout.prompt_data import PromptCursor
from .results import Cleared, Rollout


@task(name="clear_and_age_sort", cache_policy=NONE)
def clear_and_age_sort(dock: TransferDock, cursor: PromptCursor, rollout: Rollout, overlap: bool = False) -> Cleared:
    """trained_stream_ids: the groups' ids in the prompt stream; trained_group_ids: their data set indices;
    predicted_group_len / true_group_len (in the same order), predicted_groups and predictor_r: how well the per-prompt
    length history predicted the groups' mean lengths (rollout/dock/length_history.prediction_metrics).
    overlap (rollout.overlap): rows outside the batch may still be generating (the dock keeps them in flight)."""
    if not rollout.from_dock:  # custom, SFT or replayed samples never entered the dock
        ids = tuple(sorted(int(i) for i in rollout.batch.group_ids))
        return Cleared(metrics={"trained_group_ids": list(ids), "trained_stream_ids": list(ids), "carried_rows": 0,
                                "partial_rows": 0}, trained_stream_ids=ids, trained_group_ids=ids)
    stream = tuple(int(i) for i in dock.batch_group_ids())
    dataset = tuple(int(i) for i in cursor.dataset_indices(list(stream)))
    stats = dock.clear(keep_generating=overlap)
    metrics = {"trained_group_ids": list(dataset), "trained_stream_ids": list(stream),
               "carried_rows": int(stats.get("carried_rows", 0)), "partial_rows": int(stats.get("partial_rows", 0)),
               "age_histogram": stats.get("age_histogram", {}),
               **{key: stats[key] for key in PREDICTION_KEYS}}
    return Cleared(metrics=metrics, trained_stream_ids=stream, trained_group_ids=dataset)
