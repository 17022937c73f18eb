"""load-2GBS: put the next prompt groups into the dock's free slots (2 x GBS at the start and after a drain, GBS
while it runs full)."""
from __future__ import annotations

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from ..rollout.dock.transfer_dock import TransferDock
from ..rollout.prompt_data import PromptCursor, PromptSet, groups_for_iteration
from .results import Loaded


def load_prompt_groups(dock: TransferDock, cursor: PromptCursor, prompts: PromptSet, iteration: int, count: int) -> int:
    """Load `count` groups for `iteration` once; a retry of the same iteration loads nothing twice."""
    if iteration in cursor.loaded_iterations or count == 0:
        return 0
    group_ids = np.arange(cursor.position, cursor.position + count, dtype=np.int64)
    indices = cursor.dataset_indices(group_ids)
    dock.load_groups(group_ids, [prompts.tokens[i] for i in indices], [prompts.labels[i] for i in indices],
                     None if prompts.metadata is None else [prompts.metadata[i] for i in indices])
    cursor.position += count  # only after the dock took them: a failed load leaves the cursor as it was
    cursor.loaded_iterations = cursor.loaded_iterations[-7:] + [iteration]
    return count


@task(name="load_prompts", retries=2, retry_delay_seconds=1, cache_policy=NONE)
def load_prompts(dock: TransferDock, cursor: PromptCursor, prompts: PromptSet, iteration: int, num_iterations: int) -> Loaded:
    count = groups_for_iteration(dock, num_iterations)
    loaded = load_prompt_groups(dock, cursor, prompts, iteration, count)
    metrics = {"loaded_groups": loaded}
    if prompts.truncated_count:  # data.over_long_prompts=truncate, counted
        metrics["truncated_prompts"] = prompts.truncated_count
    return Loaded(metrics=metrics, groups=loaded)
