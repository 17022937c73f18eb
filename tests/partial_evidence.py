"""Evidence that partial rollout happened in a run, read from what the run left in storage: the rows a checkpoint's
dock carried over cut (read with the project's own loaders, spillover.infra.storage.checkpoint and spillover.tasks.run_state), and the samples
a later rollout trained (its debug rollout data, storage.save_debug_rollout_data).

Shared by tests/integration/test_train_flow.py and the kill -9 chains (tests/e2e/kill_chains.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CutRow:
    """One response the dock carried over unfinished: its group's stream id, its sample index (group_id * n + i),
    the tokens generated so far and the weight version of each."""
    group_id: int
    index: int
    tokens: tuple[int, ...]
    versions: tuple[int, ...]


def cut_rows(store, iteration: int) -> list[CutRow]:
    """Checkpoint `iteration`'s dock -> its cut rows: generated, not complete (callers check 0 < length < max_tokens)."""
    from spillover.infra.storage.checkpoint import load_checkpoint
    from spillover.rollout.context import restore_dock_and_cursor

    dock, _ = restore_dock_and_cursor(load_checkpoint(store, iteration))
    occupied = np.repeat(dock.group_ids >= 0, dock.n)
    rows = np.flatnonzero(occupied & dock.generated & ~dock.complete)
    out = []
    for row in rows.tolist():
        group_id = int(dock.group_ids[row // dock.n])
        one = np.array([row])
        out.append(CutRow(group_id, group_id * dock.n + row % dock.n,
                          tuple(dock.responses.gather(one, "tokens").tolist()),
                          tuple(dock.responses.gather(one, "versions").tolist())))
    return out


def trained_samples(template: str, rollout_id: int) -> dict[int, dict]:
    """The samples rollout `rollout_id` handed to the learner (its debug rollout data), by sample index:
    {index: {"group_index", "response_tokens", "weight_versions", "status"}}."""
    from spillover.rollout.debug_data import load_debug_rollout_data

    groups = load_debug_rollout_data(template, rollout_id)
    return {s.index: {"group_index": s.group_index, "response_tokens": list(s.response_tokens),
                      "weight_versions": list(s.weight_versions), "status": str(s.status)}
            for group in groups for s in group}


def assert_cut_rows_trained(cut: list[CutRow], trained: dict[int, dict], trained_version: int) -> None:
    """Every cut row is in the trained samples, continued from exactly the tokens the checkpoint held (same
    tokens, same weight versions, older than the weights that finished it), and grew past the cut."""
    assert cut, "no cut rows to follow"
    for row in cut:
        sample = trained.get(row.index)
        assert sample is not None, f"cut row {row.index} (group {row.group_id}) was not in the trained batch"
        assert sample["group_index"] == row.group_id, (row, sample["group_index"])
        k = len(row.tokens)
        assert tuple(sample["response_tokens"][:k]) == row.tokens, (row, sample["response_tokens"])
        assert tuple(sample["weight_versions"][:k]) == row.versions, (row, sample["weight_versions"])
        assert len(sample["response_tokens"]) > k, (row, sample["response_tokens"])  # generated on after the cut
        assert max(row.versions) < trained_version, (row, trained_version)  # stale tokens were trained


def assert_partial_rollout_happened(rows: list[dict], max_age: int) -> None:
    """metrics.jsonl rows: some iteration carried cut rows over, and the staleness bound was reached (a bound of
    0, max_age 1, is plain on-policy GRPO: nothing to reach)."""
    assert any(r["partial_rows"] > 0 for r in rows), [r["partial_rows"] for r in rows]
    staleness = [r["token_staleness_max"] for r in rows]
    assert max_age >= 2 and max(staleness) == max_age - 1 and min(staleness) >= 0, (staleness, max_age)
