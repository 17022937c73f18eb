"""Length-aware dispatch (rollout.scheduling = length_aware): pure functions over what the dock has generated.

The estimate reads only generated lengths and completion flags, never a token that does not exist yet:
- a row carried over with L tokens is expected to run to at least `CARRY_GROWTH x L` (a long-tailed length
  that already reached L is likely to reach a multiple of it);
- a group's finished siblings predict the rest (Seer): an unfinished row is expected to reach at least the
  longest finished sibling's length (the rows that are still running are the long ones);
- with nothing known, the prior: the mean length of the rows completed in the dock (else max_tokens / 4); with
  rollout.start_order = predicted_longest, a group whose prompt was trained in an earlier epoch expects the mean
  length its groups reached (the dock's per-prompt length history, spillover.rollout.dock.length_history), also as a
  floor over its finished siblings' (a prompt known to be long stays long when its short rows finish first).
Capped by each row's room (max_tokens, max_model_len - prompt).

    est = expected_remaining(response_len[R], complete[R], room[k], n, rows[k])   # -> float64[k]
    order = longest_first(est, ages[k])                    # -> permutation: oldest group first, then longest work
    engine = balance_engines(est[order], groups[order], loads[E])                  # -> int64[k] engine per row
    tail = split_tail(est, ages[k], max_age, factor)       # -> bool[k]: wait for the long round (tail batching)
    engine = reserve_tail_engines(est, groups, E, t, factor)  # -> int64[k]: the tail on the last t engines
    rows, engine, aside = plan_dispatch(dock, rows, scheduling, E, tail_factor, long_round, tail_engines)

Oldest group first: the staleness bound makes a batch wait for the groups at max age, so their rows go before
any younger row however long (earliest deadline first); the estimate orders rows within an age.
"""
from __future__ import annotations

import heapq

import numpy as np

CARRY_GROWTH = 2.0
SCHEDULING = ("fifo", "length_aware")
START_ORDERS = ("oldest", "predicted_longest")


def expected_remaining(response_len: np.ndarray, complete: np.ndarray, room: np.ndarray, n: int,
                       rows: np.ndarray, prior: float | None = None, history: np.ndarray | None = None) -> np.ndarray:
    """Expected tokens still to generate per row.

    response_len[R], complete[R]: every dock row's generated length and completion flag (rows g*n .. g*n+n-1
    form group g); room[k]: the most tokens row k may still have in all (max_tokens - L, context limit);
    rows[k]: the rows to estimate; history[k] (optional): the length each row's prompt reached in earlier epochs,
    NaN where unknown. -> float64[k], each in [1, room] (0 where room is 0).
    """
    response_len = np.asarray(response_len, dtype=np.int64)
    complete = np.asarray(complete, dtype=bool)
    rows = np.asarray(rows, dtype=np.int64)
    if prior is None:
        done = response_len[complete]
        prior = float(done.mean()) if len(done) else float(response_len.max(initial=0) + room.max(initial=1)) / 4
    finished = np.where(complete, response_len, 0).reshape(-1, n).max(axis=1)  # longest finished sibling, 0: none
    length = response_len[rows].astype(np.float64)
    sibling = finished[rows // n].astype(np.float64)
    total = np.where(sibling > 0, np.maximum(sibling, length + 1), prior)
    if history is not None:
        history = np.asarray(history, dtype=np.float64)
        known = ~np.isnan(history)
        total = np.where(known, np.where(sibling > 0, np.maximum(total, history), history), total)
    total = np.maximum(total, np.where(length > 0, CARRY_GROWTH * length, 0.0))
    remaining = np.clip(total - length, 1.0, None)
    return np.minimum(remaining, np.asarray(room, dtype=np.float64))


def longest_first(estimate: np.ndarray, ages: np.ndarray | None = None) -> np.ndarray:
    """Permutation putting the longest expected remaining work first (stable: ties keep the dock's order).
    ages[k] (optional) come first: older groups before younger ones (earliest staleness deadline first), the
    estimate orders within an age."""
    keys = [-np.asarray(estimate, dtype=np.float64)]
    if ages is not None:
        keys.append(-np.asarray(ages, dtype=np.int64))
    return np.lexsort(keys)


def balance_engines(estimate: np.ndarray, groups: np.ndarray, loads: np.ndarray | None = None,
                    num_engines: int | None = None) -> np.ndarray:
    """Rows (in dispatch order, longest first) -> engine per row: each goes to the engine with the least expected
    remaining tokens (LPT list scheduling), a group's rows spread over engines (among engines within one row's
    estimate of the least loaded, the one holding fewest rows of its group). loads[E]: tokens already expected
    on each engine (default zeros). -> int64[k]."""
    estimate = np.asarray(estimate, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    loads = np.zeros(num_engines or 1) if loads is None else np.asarray(loads, dtype=np.float64)
    count = len(loads)
    out = np.zeros(len(estimate), dtype=np.int64)
    if count == 1:
        return out
    heap = [(float(load), e) for e, load in enumerate(loads)]
    heapq.heapify(heap)
    per_group: dict[tuple[int, int], int] = {}
    for k, (work, group) in enumerate(zip(estimate.tolist(), groups.tolist())):
        candidates = [heapq.heappop(heap)]
        while heap and heap[0][0] <= candidates[0][0] + work:
            candidates.append(heapq.heappop(heap))
        best = min(range(len(candidates)), key=lambda c: (per_group.get((group, candidates[c][1]), 0), c))
        load, engine = candidates.pop(best)
        for item in candidates:
            heapq.heappush(heap, item)
        heapq.heappush(heap, (load + work, engine))
        per_group[(group, engine)] = per_group.get((group, engine), 0) + 1
        out[k] = engine
    return out


def split_tail(estimate: np.ndarray, ages: np.ndarray, max_age: int, factor: float) -> np.ndarray:
    """Tail batching (RollPacker): bool[k], True for rows set aside for the periodic long round: expected
    remaining work above `factor` x the median of the rows', and young enough to wait (group age + 2 < max_age:
    the long round that takes it still leaves its group a full iteration to finish within the staleness bound).
    factor <= 0: nothing is set aside."""
    estimate = np.asarray(estimate, dtype=np.float64)
    if factor <= 0 or len(estimate) == 0:
        return np.zeros(len(estimate), dtype=bool)
    return (estimate > factor * float(np.median(estimate))) & (np.asarray(ages) + 2 < max_age)


def hold_fresh_beyond(groups: np.ndarray, fresh: np.ndarray, limit: int | None) -> np.ndarray:
    """Start pacing: rows in the dock's order (oldest loaded first), groups[k] their group, fresh[k] True where the
    group has not started -> bool[k], True for the rows of the fresh groups after the first `limit` (they wait,
    unstarted: their staleness clock starts only when they do). limit None: none held."""
    held = np.zeros(len(groups), dtype=bool)
    if limit is None:
        return held
    fresh_groups = groups[fresh]
    _, first = np.unique(fresh_groups, return_index=True)
    late = fresh_groups[np.sort(first)][max(0, int(limit)):]  # fresh groups in the rows' order, past the limit
    return fresh & np.isin(groups, late)


def plan_dispatch(dock, rows: np.ndarray, scheduling: str, num_engines: int | None = None, tail_factor: float = 0.0,
                  long_round: bool = True, tail_engines: int = 0, start_order: str = "oldest",
                  fresh_limit: int | None = None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The dock's rows about to be dispatched -> (rows in dispatch order, engine per row or None, rows set aside).

    fifo: the dock's order, no engine choice, nothing set aside. length_aware: longest expected remaining work
    first (expected_remaining over the dock's generated lengths), rows balanced over num_engines engines (when
    more than one), and outside a long round (long_round False) the tail rows (split_tail) set aside. start_order
    predicted_longest: the estimate also reads the dock's per-prompt length history (see expected_remaining).
    fresh_limit (start pacing): only the first fresh_limit groups that have not started go (in the order `rows` came,
    take_rows' oldest first), the other fresh groups' rows are set aside; None: no limit.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if scheduling not in SCHEDULING:
        raise ValueError(f"rollout.scheduling must be one of {', '.join(SCHEDULING)}; got {scheduling!r}")
    if start_order not in START_ORDERS:
        raise ValueError(f"rollout.start_order must be one of {', '.join(START_ORDERS)}; got {start_order!r}")
    none = np.zeros(0, dtype=np.int64)
    if scheduling == "fifo" or len(rows) == 0:
        return rows, None, none
    history = dock.predicted_length(rows // dock.n) if start_order == "predicted_longest" else None
    estimate = expected_remaining(dock.responses.length, dock.complete, dock.max_new_tokens(rows, None), dock.n, rows,
                                  history=history)
    if not long_round:
        tail = split_tail(estimate, dock.age[rows], dock.max_age, tail_factor)
        rows, estimate, aside = rows[~tail], estimate[~tail], rows[tail]
    else:
        aside = none
    if fresh_limit is not None:  # the groups loaded first start first (take_rows' order): none waits forever
        held = hold_fresh_beyond(rows // dock.n, ~dock.started_groups()[rows // dock.n], fresh_limit)
        rows, estimate, aside = rows[~held], estimate[~held], np.concatenate([aside, rows[held]])
    order = longest_first(estimate, dock.age[rows])
    rows, estimate = rows[order], estimate[order]
    if (num_engines or 1) <= 1:
        return rows, None, aside
    if 0 < tail_engines < num_engines and tail_factor > 0:
        return rows, reserve_tail_engines(estimate, rows // dock.n, num_engines, tail_engines, tail_factor), aside
    return rows, balance_engines(estimate, rows // dock.n, num_engines=num_engines), aside


def reserve_tail_engines(estimate: np.ndarray, groups: np.ndarray, num_engines: int, tail_engines: int,
                         factor: float) -> np.ndarray:
    """Rows expected above factor x the median run on the last `tail_engines` engines, the rest on the others
    (each side balanced by balance_engines): few requests per step there, so the longest rows decode at the
    engine's fastest step rate instead of at a full batch's. -> int64[k] engine per row."""
    tail = estimate > factor * float(np.median(estimate))
    engines = np.empty(len(estimate), dtype=np.int64)
    engines[~tail] = balance_engines(estimate[~tail], groups[~tail], num_engines=num_engines - tail_engines)
    engines[tail] = num_engines - tail_engines + balance_engines(estimate[tail], groups[tail], num_engines=tail_engines)
    return engines
