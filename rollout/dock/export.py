"""Reading the transfer dock out: engine inputs, the training batch, stats, and snapshot/restore.

Pure functions over a spillover.rollout.dock.transfer_dock.TransferDock; the dock's methods are thin wrappers around them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from spillover.infra.storage.format_version import check_format_version, format_tag

if TYPE_CHECKING:
    from spillover.rollout.dock.transfer_dock import TransferDock

DOCK_FORMAT = "spillover.dock"
DOCK_FORMAT_VERSION = 1  # the snapshot layout this release writes and the only one it reads
GROUP_ARRAYS = {"group_ids": np.int64, "load_seq": np.int64, "prompt_lengths": np.int64}
ROW_ARRAYS = {"complete": bool, "stopped": bool, "generated": bool, "age": np.int32, "rounds": np.int32,
              "response_lengths": np.int64}
FLAT_ARRAYS = ("prompt_tokens", "response_tokens", "response_logprobs", "response_versions", "batch_slots")
# A multi_turn dock's snapshot also holds these and the loss mask (response_mask); a single-turn dock's rows keep
# the constructor's values (no turns, no tool pending, no env reward).
MULTI_TURN_ROW_ARRAYS = {"turns": np.int32, "awaiting_tool": bool, "env_reward": np.float32}
SNAPSHOT_META_KEYS = ("config", "has_batch", "drain", "next_load_seq", "labels", "metadata")


def batch_rows(dock: "TransferDock", batch: np.ndarray) -> np.ndarray:
    """group slots[B] -> rows[B*n], group by group."""
    return (batch[:, None] * dock.n + np.arange(dock.n)).reshape(-1)


def batch_arrays(dock: "TransferDock", batch: np.ndarray) -> dict[str, np.ndarray]:
    """The batch as columns: B groups, R = B*n rows (group by group), Tp prompt and Tr response tokens.

    group_ids[B], sample_indices[R] (= group_id*n + i), prompt_tokens[Tp] and prompt_lengths[B] (one
    prompt per group, concatenated), response_tokens[Tr], rollout_logprobs[Tr], weight_versions[Tr]
    (concatenated row by row), response_lengths[R], truncated[R] (complete without a stop), ages[R]; a multi_turn
    dock adds loss_mask[Tr] (1: policy token, 0: tool/observation token), turns[R] (tool calls) and env_rewards[R]
    (NaN: none).
    """
    rows = batch_rows(dock, batch)
    index = dock.responses.index(rows)
    columns = dock.responses.columns
    group_ids = dock.group_ids[batch]
    return {
        "group_ids": group_ids.copy(),
        "sample_indices": (group_ids[:, None] * dock.n + np.arange(dock.n)).reshape(-1),
        "prompt_tokens": dock.prompts.gather(batch, "tokens"), "prompt_lengths": dock.prompts.length[batch].copy(),
        "response_tokens": np.take(columns["tokens"], index), "rollout_logprobs": np.take(columns["logprobs"], index),
        "weight_versions": np.take(columns["versions"], index), "response_lengths": dock.responses.length[rows].copy(),
        "truncated": ~dock.stopped[rows], "ages": dock.age[rows].copy(),
        **({"loss_mask": np.take(columns["mask"], index), "turns": dock.turns[rows].copy(),
            "env_rewards": dock.env_reward[rows].copy()} if dock.multi_turn else {}),
    }


def age_histogram(dock: "TransferDock") -> dict[str, int]:
    """Loaded rows per age: {"0": count, "1": count, ...}."""
    ages, counts = np.unique(dock.age[dock.occupied_rows()], return_counts=True)
    return {str(a): int(c) for a, c in zip(ages.tolist(), counts.tolist())}


def stats(dock: "TransferDock") -> dict[str, Any]:
    """Group, row and token counts, the age histogram and buffer size (JSON-able)."""
    occupied = dock.occupied_rows()
    return {
        "loaded_groups": int(np.count_nonzero(dock.group_ids >= 0)), "ready_groups": dock.ready_group_count(),
        "complete_rows": int((occupied & dock.complete).sum()),
        "partial_rows": int((occupied & ~dock.complete & (dock.responses.length > 0)).sum()),
        "waiting_rows": int((occupied & ~dock.complete & ~dock.in_flight).sum()),
        "in_flight_rows": int(dock.in_flight.sum()), "awaiting_tool_rows": int((occupied & dock.awaiting_tool).sum()),
        "age_histogram": age_histogram(dock),
        "tokens_stored": int(dock.responses.length.sum()), "prompt_tokens_stored": int(dock.prompts.length.sum()),
        "buffer_mb": round((dock.responses.nbytes + dock.prompts.nbytes) / 2**20, 1),
        "batch_selected": dock.batch is not None, "drain": dock.drain,
    }


def snapshot(dock: "TransferDock") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """-> (arrays, JSON-able meta). Rows in flight are recorded as not in flight (see spillover.rollout.dock.transfer_dock)."""
    prompt_lengths, prompt_flat = dock.prompts.export()
    response_lengths, response_flat = dock.responses.export()
    arrays = {
        "group_ids": dock.group_ids.copy(), "load_seq": dock.load_seq.copy(), "prompt_lengths": prompt_lengths,
        "prompt_tokens": prompt_flat["tokens"],
        "complete": dock.complete.copy(), "stopped": dock.stopped.copy(), "generated": dock.generated.copy(),
        "age": dock.age.copy(), "rounds": dock.rounds.copy(), "response_lengths": response_lengths,
        "response_tokens": response_flat["tokens"], "response_logprobs": response_flat["logprobs"],
        "response_versions": response_flat["versions"],
        **({"response_mask": response_flat["mask"], "turns": dock.turns.copy(), "awaiting_tool":
            dock.awaiting_tool.copy(), "env_reward": dock.env_reward.copy()} if dock.multi_turn else {}),
        "batch_slots": np.zeros(0, dtype=np.int64) if dock.batch is None else dock.batch.copy(),
    }
    meta = {
        "format": format_tag(DOCK_FORMAT, DOCK_FORMAT_VERSION),
        "config": {"gbs": dock.gbs, "n": dock.n, "max_split": dock.max_split, "max_tokens": dock.max_tokens,
                   "max_model_len": dock.max_model_len, "eos_token_ids": dock.eos_token_ids.tolist(),
                   "max_age": dock.max_age, "require_max_age_all_finished": dock.require_max_age_all_finished,
                   "over_sampling_groups": dock.over_sampling_groups,
                   **({"multi_turn": True} if dock.multi_turn else {})},
        "has_batch": dock.batch is not None, "drain": dock.drain, "next_load_seq": int(dock.next_load_seq),
        "labels": list(dock.labels), "metadata": list(dock.metadata),
    }
    return arrays, meta


def restore(cls: type["TransferDock"], arrays: dict[str, np.ndarray], meta: dict[str, Any],
            source: str) -> "TransferDock":
    """Inverse of snapshot(); refuses a snapshot of another format version (FormatVersionError) or with
    inconsistent shapes. source: where meta was read from (a checkpoint's meta.json), named in the version error."""
    check_format_version(meta.get("format"), DOCK_FORMAT, DOCK_FORMAT_VERSION, f"dock snapshot in {source}")
    missing_meta = [key for key in SNAPSHOT_META_KEYS if key not in meta]
    if missing_meta:
        raise ValueError(f"dock snapshot in {source}: meta {missing_meta} missing")
    dock = cls(**meta["config"])
    row_arrays = {**ROW_ARRAYS, **(MULTI_TURN_ROW_ARRAYS if dock.multi_turn else {})}
    needed = set(GROUP_ARRAYS) | set(row_arrays) | set(FLAT_ARRAYS) | ({"response_mask"} if dock.multi_turn else set())
    missing = sorted(needed - set(arrays))
    if missing:
        raise ValueError(f"dock snapshot: arrays {missing} missing")
    for names, size in ((GROUP_ARRAYS, dock.capacity_groups), (row_arrays, dock.capacity_rows)):
        for name, dtype in names.items():
            value = np.asarray(arrays[name])
            if value.shape != (size,):
                raise ValueError(f"dock snapshot: {name} has shape {value.shape}, expected ({size},)")
            if name in ("prompt_lengths", "response_lengths"):
                continue
            setattr(dock, name, value.astype(dtype).copy())
    for key, entries in (("labels", meta["labels"]), ("metadata", meta["metadata"])):
        if len(entries) != dock.capacity_groups:
            raise ValueError(f"dock snapshot: {len(entries)} {key} entries for {dock.capacity_groups} group slots")
    dock.labels, dock.metadata = list(meta["labels"]), list(meta["metadata"])
    dock.prompts.load(arrays["prompt_lengths"], {"tokens": arrays["prompt_tokens"]})
    dock.responses.load(arrays["response_lengths"], {"tokens": arrays["response_tokens"],
                                                     "logprobs": arrays["response_logprobs"],
                                                     "versions": arrays["response_versions"],
                                                     **({"mask": arrays["response_mask"]} if dock.multi_turn else {})})
    dock.batch = np.asarray(arrays["batch_slots"], dtype=np.int64).copy() if meta["has_batch"] else None
    dock.drain = bool(meta["drain"])
    dock.next_load_seq = int(meta["next_load_seq"])
    _check_restored(dock)
    return dock


def _check_restored(dock: "TransferDock") -> None:
    ages = dock.age.reshape(dock.capacity_groups, dock.n)
    if (ages != ages[:, :1]).any():
        raise ValueError("dock snapshot: rows of one group have different ages (every row carries its group's age)")
    occupied = np.repeat(dock.group_ids >= 0, dock.n)
    if (dock.responses.length[~occupied] > 0).any() or (dock.prompts.length[dock.group_ids < 0] > 0).any():
        raise ValueError("dock snapshot: tokens stored for empty group slots")
    room = np.minimum(dock.max_tokens, dock.max_model_len - dock.prompt_lengths(np.arange(dock.capacity_rows)))
    if (dock.responses.length[occupied] > room[occupied]).any():
        raise ValueError("dock snapshot: a response is longer than max_tokens / max_model_len allow")
    if dock.batch is not None and not dock.ready_groups()[dock.batch].all():
        raise ValueError("dock snapshot: the selected batch holds groups that are not ready")
