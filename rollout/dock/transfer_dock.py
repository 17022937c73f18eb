"""The transfer dock: every sample of the current and the next global batch, with partial rollout.

Semantics follow MindSpeed-RL's GRPOTransferDock (see ../shared/DESIGN.md), with these choices:
- Storage is columnar. Group slot g holds one prompt group; its n rows are g*n .. g*n+n-1. Per-row
  state (complete, in flight, generated, stopped, age, rounds) lives in numpy arrays; prompts and
  partial responses (tokens, rollout logprobs, weight versions) live in paged flat columns
  (spillover.rollout.dock.buffers). Nothing on the hot path loops over rows or tokens in Python: engine inputs
  come back as TokenRows (each row's list[int] is built when the request is built), the learner reads
  `rollout_batch()` (columns; `spillover.rollout.batch.to_samples` makes the slower Sample view of it).
- Order is by key, not by moving data: rows go to generation and groups to training by (group age
  descending, load order ascending).
- The training batch is chosen once (`select_batch`) and every consumer reads that batch.
- Staleness bound (`require_max_age_all_finished`, on by default in both modes): ages are per group (every
  row carries its group's age: the updates since the group's first token, as MindSpeed-RL); a batch forms
  only when no group will ever be trained above age max_age - 1, and take_rows starts no more groups than
  the next max_age batches can take (spillover.rollout.dock.staleness). A group "at max age" (age >= max_age - 1) is
  in its max_age-th iteration; its rows are handed out first.
- Over-sampling (slime's over_sampling_batch_size, APRIL): `over_sampling_groups` extra group slots on top of
  GBS (2*GBS with partial rollout). Every iteration fills the free slots (spillover.rollout.prompt_data.
  groups_for_iteration): all of them at the start and after a drain, GBS while the dock runs full. Generation
  still stops at GBS ready groups, and the surplus -- untouched, partial (aborted rows keep their tokens) or
  even complete groups -- stays for the next iteration, oldest first. With max_split = 1 this is APRIL without
  chunked rounds; it needs a driver that stops early (the async one: abort once ready).
- Drain mode (last iterations, or the data set ran out): ready only when every loaded row is
  complete; then `select_batch` takes min(gbs, ready) groups, so repeated drains empty the dock.
- Multi-turn tool trajectories (spillover.rollout.dock.turns): per-row turns, awaiting_tool (take_rows skips those rows) and
  the env's reward, and in a `multi_turn` dock a per-token loss mask column (0: tool tokens); snapshots carry them.
  A single-turn dock has no mask column (every token is a policy token), so it pays nothing for it.
- `snapshot()` records in-flight rows as *not* in flight: their requests die with the process, and
  the tokens already written stay. After `restore` those rows are generated again from where they were.
- One controller owns the dock (not thread-safe). Each call costs ~0.1-0.5 ms of fixed numpy overhead,
  so an async driver should put finished requests in batches (e.g. at each stop-signal poll).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...infra.storage.format_version import check_format_version, format_tag
from . import staleness as dock_staleness
from ..batch import RolloutBatch
from .buffers import PagedColumns, TokenRows
from .length_history import LengthHistory, prediction_metrics, prompt_keys
from .checks import (DockError, check_dock_sizes, check_in_flight, check_load, check_occupied,
                     check_rows, parse_generation, parse_prompts)

PROMPT_DTYPES = {"tokens": np.int32}
RESPONSE_DTYPES = {"tokens": np.int32, "logprobs": np.float32, "versions": np.int32}
MASK_DTYPES = {"mask": np.uint8}  # multi_turn docks only: the loss mask (spillover.rollout.dock.turns)
# adopted: in flight, its request running on across a weight update (rollout.adopt_detached) with tokens the dock has
# not seen yet; never in a snapshot (a restored dock has nothing in flight)
ROW_FLAGS = ("complete", "in_flight", "generated", "stopped", "awaiting_tool", "adopted")


class TransferDock:
    def __init__(self, gbs: int, n: int, max_split: int, max_tokens: int, max_model_len: int,
                 eos_token_ids: Sequence[int], max_age: int | None = None,
                 require_max_age_all_finished: bool = False, over_sampling_groups: int = 0, multi_turn: bool = False):
        check_dock_sizes(gbs=gbs, n=n, max_split=max_split, max_tokens=max_tokens, max_model_len=max_model_len,
                         max_age=max_age, over_sampling_groups=over_sampling_groups)
        self.gbs, self.n, self.max_split = int(gbs), int(n), int(max_split)
        self.max_tokens, self.max_model_len = int(max_tokens), int(max_model_len)
        self.eos_token_ids = np.asarray(sorted(set(int(t) for t in eos_token_ids)), dtype=np.int64)
        self.max_age = self.max_split if max_age is None else int(max_age)
        self.require_max_age_all_finished = bool(require_max_age_all_finished)
        self.partial = self.max_split > 1
        self.over_sampling_groups = int(over_sampling_groups)
        self.capacity_groups = (2 * self.gbs if self.partial else self.gbs) + self.over_sampling_groups
        self.capacity_rows = self.capacity_groups * self.n
        self.group_ids = np.full(self.capacity_groups, -1, dtype=np.int64)  # -1: free slot
        self.load_seq = np.zeros(self.capacity_groups, dtype=np.int64)
        self.prompt_keys = np.zeros(self.capacity_groups, dtype=np.int64)  # the prompt's key in length_history
        self.length_history = LengthHistory()  # per-prompt mean lengths of trained groups, across epochs
        # what the history predicted for each group when it started (NaN: nothing): its record at clear
        self.start_predictions = np.full(self.capacity_groups, np.nan, dtype=np.float64)
        self.labels: list[Any] = [None] * self.capacity_groups
        self.metadata: list[dict | None] = [None] * self.capacity_groups  # data.additional_keys per group (JSON)
        self.next_load_seq = 0
        for flag in ROW_FLAGS:
            setattr(self, flag, np.zeros(self.capacity_rows, dtype=bool))
        self.age = np.zeros(self.capacity_rows, dtype=np.int32)
        self.rounds = np.zeros(self.capacity_rows, dtype=np.int32)
        self.turns = np.zeros(self.capacity_rows, dtype=np.int32)  # multi-turn: tool calls made (spillover.rollout.dock.turns)
        self.env_reward = np.full(self.capacity_rows, np.nan, dtype=np.float32)  # the env's latest reward, NaN: none
        self.prompts = PagedColumns(self.capacity_groups, self.max_model_len - 1, PROMPT_DTYPES, page_size=128)
        self.multi_turn = bool(multi_turn)
        dtypes = {**RESPONSE_DTYPES, **MASK_DTYPES} if multi_turn else RESPONSE_DTYPES
        self.responses = PagedColumns(self.capacity_rows, self.max_tokens, dtypes, page_size=256)
        self.batch: np.ndarray | None = None
        self._batch_arrays: dict[str, np.ndarray] | None = None
        self.drain = False

    @classmethod
    def from_config(cls, rollout_cfg, eos_token_ids: Sequence[int]) -> "TransferDock":
        """From an spillover.infra.config.run_config.RolloutConfig."""
        return cls(rollout_cfg.global_batch_size, rollout_cfg.n_samples_per_prompt, rollout_cfg.max_split,
                   rollout_cfg.max_tokens, rollout_cfg.max_model_len, eos_token_ids, rollout_cfg.effective_max_age,
                   rollout_cfg.require_max_age_all_finished, rollout_cfg.over_sampling_groups,
                   multi_turn=bool(rollout_cfg.env_path))

    # ---- derived views -------------------------------------------------------------------------
    def occupied_rows(self) -> np.ndarray:
        return np.repeat(self.group_ids >= 0, self.n)

    def group_age(self) -> np.ndarray:
        """int32[G] (a view): every row of a group carries the group's age (clear and restore keep it so)."""
        return self.age[::self.n]

    def started_groups(self) -> np.ndarray:
        """bool[G]: occupied and holding a response token or a complete row (the group's age clock runs)."""
        held = (self.responses.length > 0) | self.complete | self.adopted
        return (self.group_ids >= 0) & held.reshape(self.capacity_groups, self.n).any(axis=1)

    def ready_groups(self) -> np.ndarray:
        """bool[G]: occupied and all n rows complete."""
        return (self.group_ids >= 0) & self.complete.reshape(self.capacity_groups, self.n).all(axis=1)

    def oldest_first(self, slots: np.ndarray) -> np.ndarray:
        """slots[k] (repeats allowed: a group's rows) -> the stable permutation ordering them oldest first:
        age descending, then load order."""
        key = self.group_age()[slots].astype(np.int64) * -(1 << 40) + self.load_seq[slots]
        return np.argsort(key, kind="stable")

    def predicted_length(self, slots: np.ndarray) -> np.ndarray:
        """float64[k]: the mean response length the groups' prompts reached in earlier epochs; NaN: no history."""
        return self.length_history.predict(self.prompt_keys[np.asarray(slots, dtype=np.int64)])

    def prompt_lengths(self, rows: np.ndarray) -> np.ndarray:
        return self.prompts.length[np.asarray(rows, dtype=np.int64) // self.n]

    # ---- loading -------------------------------------------------------------------------------
    def free_group_slots(self) -> int:
        return int(np.count_nonzero(self.group_ids < 0))

    def load_groups(self, group_ids: np.ndarray | Sequence[int], prompt_tokens, labels: Sequence[Any],
                    metadata: Sequence[dict | None] | None = None, keys: Sequence[int] | None = None) -> np.ndarray:
        """Load k prompt groups (n rows each) into free slots; -> slots[k]. A group id already here is an error.
        metadata: a JSON-able dict per group (data.additional_keys), kept next to its label. keys: each prompt's key
        in the length history (default: a digest of its token ids, the same whenever the prompt recurs)."""
        ids, flat, lengths = parse_prompts(group_ids, prompt_tokens, labels, self.max_model_len)
        check_load(ids, metadata, self.group_ids, self.batch is not None)
        if keys is not None and len(keys) != len(ids):
            raise ValueError(f"load_groups: {len(keys)} keys for {len(ids)} groups")
        slots = np.flatnonzero(self.group_ids < 0)[:len(ids)]
        self.group_ids[slots] = ids
        self.prompt_keys[slots] = prompt_keys(flat, lengths) if keys is None else np.asarray(keys, dtype=np.int64)
        self.start_predictions[slots] = self.length_history.predict(self.prompt_keys[slots])
        self.load_seq[slots] = self.next_load_seq + np.arange(len(ids))
        self.next_load_seq += len(ids)
        for slot, label, meta in zip(slots.tolist(), labels, metadata if metadata is not None else [None] * len(ids)):
            self.labels[slot], self.metadata[slot] = label, meta
        self.prompts.append(slots, lengths, {"tokens": flat})
        return slots

    # ---- generation ----------------------------------------------------------------------------
    def take_rows(self, limit: int | None = None) -> np.ndarray:
        """Rows to generate (not complete, not in flight, no tool call pending), carried-over/oldest first; marks
        them in flight.
        With the staleness bound (outside drain mode), rows of groups that may not start yet stay back."""
        if limit is not None and limit < 0:
            raise ValueError(f"take_rows: limit must be >= 0 or None; got {limit}")
        waiting = self.occupied_rows() & ~self.complete & ~self.in_flight & ~self.awaiting_tool
        if self.require_max_age_all_finished and not self.drain:
            held_back = dock_staleness.groups_held_back(self)
            waiting[(held_back[:, None] * self.n + np.arange(self.n)).reshape(-1)] = False
        waiting = np.flatnonzero(waiting)
        rows = waiting[self.oldest_first(waiting // self.n)][:limit]
        self.in_flight[rows] = True
        return rows

    def max_new_tokens(self, rows: np.ndarray, round_tokens: int | None) -> np.ndarray:
        """int64[k]: min(round_tokens, max_tokens - response, max_model_len - prompt - response)."""
        resp = self.responses.length[rows]
        room = np.minimum(self.max_tokens - resp, self.max_model_len - self.prompt_lengths(rows) - resp)
        if round_tokens is not None:
            room = np.minimum(room, int(round_tokens))
        return np.maximum(room, 0)

    def generation_inputs(self, rows, round_tokens: int | None) -> tuple[TokenRows, np.ndarray]:
        """-> (prompt + partial response ids per row, max_new_tokens int64[k]).

        The ids are a TokenRows: a sequence whose item i is row i's list[int], built on access.
        """
        rows = check_occupied(check_rows(rows, self.capacity_rows, "generation_inputs"), self.group_ids, self.n,
                              "generation_inputs")
        if round_tokens is not None and round_tokens < 1:
            raise ValueError(f"generation_inputs: round_tokens must be >= 1 or None; got {round_tokens}")
        return TokenRows(self.prompts, rows // self.n, self.responses, rows), self.max_new_tokens(rows, round_tokens)

    def put_generation(self, rows, tokens, logprobs, weight_version: int | np.ndarray,
                       finished_by_stop: np.ndarray | Sequence[bool], current_version: int | None = None) -> None:
        """Append generated tokens/logprobs/version to in-flight rows; they leave the in-flight state.

        tokens and logprobs: list of per-row lists, or (flat, lengths). A row is complete on a stop
        (finished_by_stop, or its last new token is an EOS id), on prompt+response >= max_model_len, or
        on response >= max_tokens. Any inconsistency raises before anything changes. current_version (the
        weights being trained now; rollout.overlap): tokens made by older weights (they generated through an
        update, outside the dock) age their group to at least current_version - their version.
        """
        rows = check_in_flight(check_rows(rows, self.capacity_rows, "put_generation"), self.in_flight, "put_generation")
        k = len(rows)
        flat, lengths, flat_lp, versions, stop = parse_generation(
            rows, tokens, logprobs, weight_version, finished_by_stop, self.max_new_tokens(rows, None))
        has_new = lengths > 0
        last = np.full(k, -1, dtype=np.int64)
        last[has_new] = flat[np.cumsum(lengths)[has_new] - 1]
        stopped = stop | np.isin(last, self.eos_token_ids)
        response = self.responses.length[rows] + lengths
        limit = np.minimum(self.max_tokens, self.max_model_len - self.prompt_lengths(rows))
        complete = stopped | (response >= limit)
        one_version = len(versions) == 0 or bool((versions == versions[0]).all())
        self.responses.append(rows, lengths, {  # one version for every token (the common case) broadcasts
            "tokens": flat, "logprobs": flat_lp, "mask": 1,  # (a mask column exists in multi_turn docks only)
            "versions": versions[0] if one_version and len(versions) else versions.astype(np.int32)})
        if current_version is not None and len(versions):
            row_of_token = np.repeat(rows, lengths)
            lag = np.zeros(self.capacity_groups, dtype=np.int64)
            np.maximum.at(lag, row_of_token // self.n, int(current_version) - versions.astype(np.int64))
            self.age[:] = np.maximum(self.age, np.repeat(lag, self.n)).astype(self.age.dtype)
        self.complete[rows] = complete
        self.stopped[rows] = stopped
        self.generated[rows] = True
        self.rounds[rows] += 1
        self.in_flight[rows] = False
        self.adopted[rows] = False

    def adopt_in_flight(self, rows, sent_version: int, current_version: int) -> None:
        """In-flight rows whose requests, sent under weights `sent_version`, run on past a weight update
        (rollout.adopt_detached): their tokens arrive later, so until then their groups count as started and are at
        least current_version - sent_version old, as if each held a token of sent_version (it may hold one)."""
        rows = check_in_flight(check_rows(rows, self.capacity_rows, "adopt_in_flight"), self.in_flight,
                               "adopt_in_flight")
        self.adopted[rows] = True
        groups = np.unique(rows // self.n)
        ages = self.age.reshape(self.capacity_groups, self.n)
        ages[groups] = np.maximum(ages[groups], int(current_version) - int(sent_version))

    def release(self, rows) -> None:
        """In-flight rows come back with no new tokens (their request was dropped or aborted empty)."""
        rows = check_in_flight(check_rows(rows, self.capacity_rows, "release"), self.in_flight, "release")
        self.in_flight[rows] = False
        self.adopted[rows] = False

    # ---- stopping and the batch ----------------------------------------------------------------
    def ready_group_count(self) -> int:
        return int(np.count_nonzero(self.ready_groups()))

    def set_drain(self, drain: bool) -> None:
        """Drain mode: generation is ready only once every loaded row is complete."""
        self.drain = bool(drain)

    def _all_loaded_complete(self) -> bool:
        occupied = self.occupied_rows()
        return bool(occupied.any()) and bool(self.complete[occupied].all())

    def update_ready(self) -> bool:
        """May generation stop? >= gbs ready groups (+ the staleness bound, by group: see spillover.rollout.dock.staleness);
        in drain mode: every loaded row complete."""
        if self.drain:
            return self._all_loaded_complete()
        ready = np.flatnonzero(self.ready_groups())
        if len(ready) < self.gbs:
            return False
        if not self.require_max_age_all_finished:
            return True
        return dock_staleness.batch_may_form(self, ready[self.oldest_first(ready)][:self.gbs])

    def select_batch(self) -> np.ndarray:
        """Choose the training batch once: gbs ready groups, oldest first; -> group slots (same until clear())."""
        if self.batch is None:
            ready = np.flatnonzero(self.ready_groups())
            ready = ready[self.oldest_first(ready)]
            if len(ready) < self.gbs and not (self.drain and self._all_loaded_complete()):
                raise DockError(f"select_batch: {len(ready)} ready groups, need gbs={self.gbs} "
                                "(generate until update_ready(), or set_drain(True) at the end of the data)")
            self.batch = ready[:self.gbs]
        return self.batch.copy()

    def _require_batch(self, what: str) -> np.ndarray:
        if self.batch is None:
            raise DockError(f"{what}: no batch selected; call select_batch() first")
        return self.batch

    def batch_group_ids(self) -> np.ndarray:
        return self.group_ids[self._require_batch("batch_group_ids")].copy()

    def rollout_batch(self) -> RolloutBatch:
        """The batch as the learner's columns (rollout/batch.py), group by group in batch order."""
        slots = self._require_batch("rollout_batch")
        return RolloutBatch.from_dock_arrays(self.batch_arrays(), self.n, [self.labels[s] for s in slots.tolist()],
                                             [self.metadata[s] for s in slots.tolist()])

    def batch_arrays(self) -> dict[str, np.ndarray]:
        """The batch as flat read-only columns (see batch_arrays below); built once per batch."""
        if self._batch_arrays is None:
            self._batch_arrays = batch_arrays(self, self._require_batch("batch_arrays"))
            for array in self._batch_arrays.values():
                array.flags.writeable = False
        return dict(self._batch_arrays)

    def clear(self, keep_generating: bool = False) -> dict:
        """Batch groups leave; every other generated row ages by one. -> small JSON-able stats, with the history's
        predictions for the batch's groups when they started against their mean lengths (prediction_metrics).

        keep_generating (rollout.overlap): rows outside the batch may still be in flight (their requests run on
        through the update); they stay so. Tokens they make outside the dock age their group when they arrive
        (put_generation's current_version)."""
        batch = self._require_batch("clear")
        rows = (batch[:, None] * self.n + np.arange(self.n)).reshape(-1)
        flying = int(self.in_flight[rows].sum()) if keep_generating else int(self.in_flight.sum())
        if flying:
            raise DockError(f"clear: {flying} {'batch ' if keep_generating else ''}rows are in flight; "
                            "put_generation() or release() them first")
        means = self.responses.length[rows].reshape(len(batch), self.n).mean(axis=1)
        predicted = self.start_predictions[batch].copy()
        self.length_history.record(self.prompt_keys[batch], means)
        self.start_predictions[batch] = np.nan
        self.group_ids[batch] = -1
        for slot in batch.tolist():
            self.labels[slot] = self.metadata[slot] = None
        for flag in ROW_FLAGS:
            getattr(self, flag)[rows] = False
        self.age[rows] = 0
        self.rounds[rows] = 0
        self.turns[rows] = 0
        self.env_reward[rows] = np.nan
        self.prompts.free(batch)
        self.responses.free(rows)
        self.age += np.repeat(self.started_groups(), self.n)  # a group ages as one, from its first token
        # groups not dispatched yet will start with the history as it is now (what the driver reads then)
        waiting = (self.group_ids >= 0) & ~self.started_groups() & ~self.in_flight.reshape(-1, self.n).any(axis=1)
        self.start_predictions[waiting] = self.length_history.predict(self.prompt_keys[waiting])
        self.batch, self._batch_arrays = None, None
        carried = self.occupied_rows() & self.generated
        return {"trained_groups": int(len(batch)), "carried_rows": int(carried.sum()),
                "partial_rows": int((carried & ~self.complete & (self.responses.length > 0)).sum()),
                "age_histogram": age_histogram(self), **prediction_metrics(predicted, means)}

    # ---- state ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Small JSON-able counts (see stats below)."""
        return stats(self)

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict]:
        """Complete state as (arrays, JSON-able metadata); in-flight rows are recorded as not in flight."""
        return snapshot(self)

    @classmethod
    def restore(cls, arrays: dict[str, np.ndarray], meta: dict, source: str) -> "TransferDock":
        """source: where the snapshot was read from (named in errors)."""
        return restore(cls, arrays, meta, source)


# ---- reading the dock out: engine inputs, the training batch, stats, snapshot and restore, as pure functions over
# the dock (its methods above are thin wrappers around them)
DOCK_FORMAT = "spillover.dock"
DOCK_FORMAT_VERSION = 1  # the snapshot layout this release writes and the only one it reads
GROUP_ARRAYS = {"group_ids": np.int64, "load_seq": np.int64, "prompt_lengths": np.int64}
ROW_ARRAYS = {"complete": bool, "stopped": bool, "generated": bool, "age": np.int32, "rounds": np.int32,
              "response_lengths": np.int64}
FLAT_ARRAYS = ("prompt_tokens", "response_tokens", "response_logprobs", "response_versions", "batch_slots")
# A multi_turn dock's snapshot also holds these and the loss mask (response_mask); a single-turn dock's rows keep
# the constructor's values (no turns, no tool pending, no env reward).
MULTI_TURN_ROW_ARRAYS = {"turns": np.int32, "awaiting_tool": bool, "env_reward": np.float32}
NO_PREDICTION = -1.0  # a group without a start prediction, in a snapshot (NaN in the dock)
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
    history_keys, history_lengths = dock.length_history.export()
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
        "prompt_keys": dock.prompt_keys.copy(), "history_keys": history_keys, "history_lengths": history_lengths,
        "start_predictions": np.nan_to_num(dock.start_predictions, nan=NO_PREDICTION),  # NaN != NaN in comparisons
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
    _restore_history(dock, arrays)
    _check_restored(dock)
    return dock


def _restore_history(dock: "TransferDock", arrays: dict[str, np.ndarray]) -> None:
    """The prompt keys, length history and start predictions (optional: a snapshot from before them restores the keys
    as digests of the prompts and starts an empty history; the predictions are then the history's now)."""
    if "prompt_keys" in arrays:
        keys = np.asarray(arrays["prompt_keys"], dtype=np.int64)
        if keys.shape != (dock.capacity_groups,):
            raise ValueError(f"dock snapshot: prompt_keys has shape {keys.shape}, expected ({dock.capacity_groups},)")
        dock.prompt_keys = keys.copy()
    else:
        slots = np.flatnonzero(dock.group_ids >= 0)
        dock.prompt_keys[slots] = prompt_keys(dock.prompts.gather(slots, "tokens"), dock.prompts.length[slots])
    if "history_keys" in arrays:
        dock.length_history = LengthHistory.load(arrays["history_keys"], arrays["history_lengths"])
    occupied = dock.group_ids >= 0
    if "start_predictions" in arrays:
        predictions = np.asarray(arrays["start_predictions"], dtype=np.float64)
        if predictions.shape != (dock.capacity_groups,):
            raise ValueError(f"dock snapshot: start_predictions has shape {predictions.shape}, "
                             f"expected ({dock.capacity_groups},)")
        dock.start_predictions = np.where(occupied & (predictions >= 0), predictions, np.nan)
    else:
        dock.start_predictions[occupied] = dock.length_history.predict(dock.prompt_keys[occupied])


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
