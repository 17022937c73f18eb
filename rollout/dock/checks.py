"""Input checks of the transfer dock: every misuse raises one clear error before anything changes."""
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

INT32_MAX = np.iinfo(np.int32).max


class DockError(RuntimeError):
    """The dock was used out of order (e.g. clear() before select_batch())."""


def check_dock_sizes(*, gbs, n, max_split, max_tokens, max_model_len, max_age, over_sampling_groups) -> None:
    """TransferDock's constructor arguments: integers in range (max_age may be None: = max_split)."""
    for name, value, low in (("gbs", gbs, 1), ("n", n, 1), ("max_split", max_split, 1),
                             ("max_tokens", max_tokens, 1), ("max_model_len", max_model_len, 2)):
        if int(value) != value or value < low:
            raise ValueError(f"TransferDock: {name} must be an integer >= {low}; got {value!r}")
    if int(over_sampling_groups) != over_sampling_groups or over_sampling_groups < 0:
        raise ValueError(f"TransferDock: over_sampling_groups must be an integer >= 0; got {over_sampling_groups!r}")
    if max_age is not None and max_age < 1:
        raise ValueError(f"TransferDock: max_age must be >= 1 or None (= max_split); got {max_age}")


def check_load(ids: np.ndarray, metadata, group_ids: np.ndarray, batch_selected: bool) -> None:
    """load_groups(ids[k], ..., metadata) into a dock whose slots hold group_ids (-1: free)."""
    if metadata is not None and len(metadata) != len(ids):
        raise ValueError(f"load_groups: {len(ids)} group ids but {len(metadata)} metadata entries")
    if batch_selected:
        raise DockError("load_groups: a training batch is selected; call clear() before loading")
    free = int(np.count_nonzero(group_ids < 0))
    if len(ids) > free:
        raise ValueError(f"load_groups: {len(ids)} groups but only {free} free slots "
                         "(ask free_group_slots() how many fit)")
    present = ids[np.isin(ids, group_ids)]
    if len(present):
        raise ValueError(f"load_groups: groups {present[:5].tolist()} are already in the dock")


def check_rows(rows: Sequence[int] | np.ndarray, n_rows: int, what: str) -> np.ndarray:
    """Any row-index sequence -> int64[k], refusing non-integers, out-of-range indices and repeats."""
    arr = np.asarray(rows)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: rows must be a 1-D sequence of integers; got dtype {arr.dtype} shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    bad = arr[(arr < 0) | (arr >= n_rows)]
    if len(bad):
        raise IndexError(f"{what}: row indices {bad[:5].tolist()} out of range [0, {n_rows})")
    if len(np.unique(arr)) != len(arr):
        values, counts = np.unique(arr, return_counts=True)
        raise ValueError(f"{what}: rows {values[counts > 1][:5].tolist()} given more than once")
    return arr


def check_occupied(rows: np.ndarray, group_ids: np.ndarray, n: int, what: str) -> np.ndarray:
    """rows[k] -> rows, refusing rows of empty group slots (group_ids[slot] < 0; slot = row // n)."""
    empty = rows[group_ids[rows // n] < 0]
    if len(empty):
        raise IndexError(f"{what}: rows {empty[:5].tolist()} belong to empty group slots")
    return rows


def check_in_flight(rows: np.ndarray, in_flight: np.ndarray, what: str) -> np.ndarray:
    """rows[k] -> rows, refusing rows that are not in flight (in_flight: bool per dock row)."""
    idle = rows[~in_flight[rows]]
    if len(idle):
        raise DockError(f"{what}: rows {idle[:5].tolist()} are not in flight (take_rows() hands rows out; "
                        "each comes back once, by put_generation() or release())")
    return rows


def to_flat(values, name: str, dtype, integer: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """list[list] | (flat[T], lengths[k]) -> (flat[T] as dtype, lengths[k] int64); integer: refuse floats."""
    if isinstance(values, tuple):
        if len(values) != 2:
            raise ValueError(f"{name}: pass a list of per-row lists or a (flat, lengths) pair")
        flat, lengths = np.asarray(values[0]), np.asarray(values[1], dtype=np.int64)
        if flat.ndim != 1 or lengths.ndim != 1:
            raise ValueError(f"{name}: flat values and lengths must be 1-D")
        if (lengths < 0).any() or int(lengths.sum()) != len(flat):
            raise ValueError(f"{name}: lengths sum to {int(lengths.sum())} but there are {len(flat)} values")
        if integer and len(flat) and not np.issubdtype(flat.dtype, np.integer):
            raise ValueError(f"{name}: token ids must be integers; got dtype {flat.dtype}")
        return flat.astype(dtype, copy=False), lengths
    if isinstance(values, np.ndarray) and values.dtype != object:
        raise ValueError(f"{name}: a single array is ambiguous; pass a list of per-row lists or (flat, lengths)")
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    count = int(lengths.sum())
    if not integer:
        return np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=count), lengths
    # via float64 (exact below 2**53) so that a non-integer id is refused instead of truncated
    as_float = np.fromiter(itertools.chain.from_iterable(values), dtype=np.float64, count=count)
    if count and not np.array_equal(as_float, np.floor(as_float)):
        raise ValueError(f"{name}: token ids must be integers")
    return as_float.astype(dtype), lengths


def check_token_values(flat: np.ndarray, what: str) -> None:
    if len(flat) and (flat.min() < 0 or flat.max() > INT32_MAX):
        raise ValueError(f"{what}: token ids must be in [0, 2**31); got {int(flat.min())} .. {int(flat.max())}")


def parse_prompts(group_ids, prompt_tokens, labels: Sequence[Any], max_model_len: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (group ids int64[k], prompt tokens int32[T], prompt lengths int64[k]), refusing bad input."""
    ids = np.asarray(group_ids, dtype=np.int64).reshape(-1)
    k = len(ids)
    if len(prompt_tokens) != k or len(labels) != k:
        raise ValueError(f"load_groups: {k} group ids, {len(prompt_tokens)} prompts, {len(labels)} labels; "
                         "pass one prompt and one label per group")
    if (ids < 0).any():
        raise ValueError(f"load_groups: group ids must be >= 0; got {ids[ids < 0][:5].tolist()}")
    if len(np.unique(ids)) != k:
        raise ValueError("load_groups: a group id appears twice in one call")
    flat, lengths = to_flat(list(prompt_tokens), "load_groups prompt_tokens", np.int64, integer=True)
    bad = (lengths < 1) | (lengths >= max_model_len)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"load_groups: prompt of group {int(ids[i])} has {int(lengths[i])} tokens; it needs "
                         f"1 .. max_model_len-1 = {max_model_len - 1} (truncate or refuse it upstream)")
    check_token_values(flat, "load_groups prompt_tokens")
    try:
        json.dumps(list(labels))
    except (TypeError, ValueError) as err:
        raise ValueError(f"load_groups: labels must be JSON-able (they go into checkpoints): {err}") from None
    return ids, flat.astype(np.int32), lengths


def parse_generation(rows: np.ndarray, tokens, logprobs, weight_version, finished_by_stop, room: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One put_generation call -> (tokens int32[T], lengths int64[k], logprobs float32[T],
    versions int64[T] (each token's weight version), finished_by_stop bool[k]); room[k]: the most tokens each row may
    still take. weight_version: one int, one per row, or one sequence per row with a version per token (a request
    that lived through a weight update)."""
    k = len(rows)
    flat, lengths = to_flat(tokens, "put_generation tokens", np.int64, integer=True)
    flat_lp, lengths_lp = to_flat(logprobs, "put_generation logprobs", np.float32)
    stop = np.asarray(finished_by_stop, dtype=bool).reshape(-1)
    per_token = isinstance(weight_version, list) and any(np.ndim(v) == 1 for v in weight_version)
    if per_token:
        versions, lengths_v = to_flat(weight_version, "put_generation weight_version", np.int64, integer=True)
    else:
        versions = np.asarray(weight_version, dtype=np.int64).reshape(-1)
        if versions.shape == (1,) and np.ndim(weight_version) == 0:
            versions = np.broadcast_to(versions, (k,))
        lengths_v = lengths
    for name, got in (("tokens", len(lengths)), ("logprobs", len(lengths_lp)), ("finished_by_stop", len(stop)),
                      ("weight_version", len(lengths_v) if per_token else len(versions))):
        if got != k:
            raise ValueError(f"put_generation: {k} rows but {got} entries in {name}")
    if len(versions) and (versions.min() < 0 or versions.max() > INT32_MAX):
        raise ValueError(f"put_generation: weight_version must be in [0, 2**31); got {versions.min()}..{versions.max()}")
    for other, name in ((lengths_lp, "logprobs"), (lengths_v, "weight versions")):
        if not np.array_equal(lengths, other):
            i = int(np.flatnonzero(lengths != other)[0])
            raise ValueError(f"put_generation: row {int(rows[i])} has {int(lengths[i])} tokens but "
                             f"{int(other[i])} {name}")
    if not per_token:
        versions = np.repeat(versions, lengths)
    check_token_values(flat, "put_generation tokens")
    over = lengths > room
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"put_generation: row {int(rows[i])} got {int(lengths[i])} tokens, more than its room of "
                         f"{int(room[i])} (max_tokens / max_model_len)")
    return flat.astype(np.int32), lengths, flat_lp, versions, stop
