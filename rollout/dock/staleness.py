"""The staleness bound of the transfer dock, as pure functions over group ages.

A group's age counts the updates since its first response token was generated (every row of a group
carries the group's age, as in MindSpeed-RL). With weight version = iteration, a token of a group of age a
is trained a updates after it was generated. The bound: no group is trained at an age above max_age - 1.

Each iteration trains exactly gbs groups, oldest first, so the bound is a deadline schedule: a group
started now must be trained within max_age updates. Two rules keep it feasible (earliest deadline first):
- at most gbs * max_age groups are started and not yet trained (`fresh_groups_allowed`, applied by
  take_rows: with over-sampling, extra groups wait instead of starting a clock that cannot be met);
- a batch may form only when, for every age a, it holds enough of the groups aged >= a that the later
  batches can take the rest in time (`staleness_bound_met`). Without over-sampling this is exactly
  "every group at age >= max_age - 1 is complete" (they are at most gbs and come first).
"""
from __future__ import annotations

import numpy as np


def counts_at_least(ages: np.ndarray, max_age: int) -> np.ndarray:
    """ages[k] (>= 0) -> int64[max_age]: entry a counts ages >= a (ages above max_age - 1 count as max_age - 1)."""
    clipped = np.minimum(np.asarray(ages, dtype=np.int64), max_age - 1)
    return np.bincount(clipped, minlength=max_age)[::-1].cumsum()[::-1]


def staleness_bound_met(started_ages: np.ndarray, batch_ages: np.ndarray, max_age: int, gbs: int) -> bool:
    """May this batch train now without any group ever exceeding age max_age - 1?

    started_ages[k]: ages of every started, untrained group (the batch's included); batch_ages[b]: ages of
    the gbs groups the batch would take (oldest ready first). Groups aged >= a must be trained within the
    next max_age - a updates, gbs groups each, so the batch holds at least
    min(count(aged >= a) - gbs * (max_age - 1 - a), gbs) of them. When that is impossible anyway (more
    overdue groups than one batch, e.g. after the bound was switched on mid-run) the batch must be the gbs
    oldest: finishing every started row always satisfies the rule, so generation cannot deadlock on it.
    """
    slack = gbs * (max_age - 1 - np.arange(max_age))
    needed = np.minimum(counts_at_least(started_ages, max_age) - slack, gbs)
    return bool((counts_at_least(batch_ages, max_age) >= needed).all())


def fresh_groups_allowed(active_groups: int, max_age: int, gbs: int) -> int:
    """How many more groups may start generating, given `active_groups` started (or in flight) and not yet
    trained: at most gbs * max_age, the groups the next max_age batches can take."""
    return max(0, gbs * max_age - int(active_groups))


def groups_held_back(dock) -> np.ndarray:
    """Group slots of a spillover.rollout.dock.transfer_dock.TransferDock that may not start generating yet: the fresh groups beyond
    what the next max_age batches can take (oldest first are let through)."""
    active = dock.started_groups() | dock.in_flight.reshape(dock.capacity_groups, dock.n).any(axis=1)
    fresh = np.flatnonzero((dock.group_ids >= 0) & ~active)
    return fresh[dock.oldest_first(fresh)][fresh_groups_allowed(int(active.sum()), dock.max_age, dock.gbs):]


def batch_may_form(dock, batch: np.ndarray) -> bool:
    """With `batch` (the group slots select_batch would take), is no started group of the dock left to be
    trained above age max_age - 1?"""
    ages = dock.group_age()
    return staleness_bound_met(ages[dock.started_groups()], ages[batch], dock.max_age, dock.gbs)
