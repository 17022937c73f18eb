"""Multi-turn state of the transfer dock (issue 15), as functions over a spillover.rollout.dock.transfer_dock.TransferDock.

In a `multi_turn` dock (TransferDock(..., multi_turn=True); from_config with rollout.env_path) each response token
has a loss mask (1: made by the policy, with its rollout logprob and weight version; 0: a
tool/observation token, logprob 0.0 and the weight version of the policy token before it, so the staleness of a
trajectory is that of its policy tokens). Per row: `turns` (tool calls made, the pending one included),
`awaiting_tool` (a tool call was made and its observation is not in the dock yet: take_rows skips the row) and
`env_reward` (the env's latest reward, NaN: none). A snapshot carries all of it (spillover.rollout.dock.transfer_dock.snapshot).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .checks import DockError


def enable(dock) -> None:
    """Give a dock the loss-mask column (every token so far a policy token): a run that resumes a single-turn
    checkpoint with rollout.env_path set."""
    if not dock.multi_turn:
        dock.responses.dtypes["mask"] = np.dtype(np.uint8)
        dock.responses.columns["mask"] = np.ones(len(dock.responses.columns["tokens"]), dtype=np.uint8)
        dock.multi_turn = True


def begin_tool_calls(dock, rows: np.ndarray) -> None:
    """Rows whose last answer ended on a tool-call stop (not complete, not in flight): awaiting_tool, turns + 1."""
    rows = np.asarray(rows, dtype=np.int64)
    if (dock.complete[rows] | dock.in_flight[rows]).any():
        raise ValueError("begin_tool_calls: rows must be neither complete nor in flight")
    dock.awaiting_tool[rows] = True
    dock.turns[rows] += 1


def end_episodes(dock, rows: np.ndarray, stopped: bool) -> None:
    """Rows end here (env done: stopped=True; max_turns or a tool error with on_tool_error=end: stopped=False, i.e.
    truncated); they are complete and no longer wait for a tool."""
    rows = np.asarray(rows, dtype=np.int64)
    dock.complete[rows] = True
    dock.stopped[rows] = bool(stopped)
    dock.awaiting_tool[rows] = False


def set_env_rewards(dock, rows: np.ndarray, rewards: Sequence[float]) -> None:
    dock.env_reward[np.asarray(rows, dtype=np.int64)] = np.asarray(rewards, dtype=np.float32)


def last_versions(dock, rows: np.ndarray, default: int) -> np.ndarray:
    """int32[k]: the weight version of each row's last response token (default for an empty response)."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.full(len(rows), int(default), dtype=np.int32)
    length = dock.responses.length[rows]
    held = length > 0
    if held.any():
        index = dock.responses.index(rows[held], length[held] - 1, length[held])
        out[held] = np.take(dock.responses.columns["versions"], index)
    return out


def put_observations(dock, rows: np.ndarray, tokens: Sequence[Sequence[int]], default_version: int) -> np.ndarray:
    """Append observation tokens (mask 0, logprob 0.0, the version of the row's last token; default_version before
    any) to rows that are not in flight; they leave awaiting_tool. An observation longer than the row's room
    (max_tokens, max_model_len) is cut there, and a row whose room it fills is complete (truncated).
    -> int64[k]: tokens appended per row."""
    if not dock.multi_turn:
        raise DockError("put_observations: the dock has no loss-mask column (TransferDock(..., multi_turn=True))")
    rows = np.asarray(rows, dtype=np.int64)
    room = dock.max_new_tokens(rows, None)
    kept = [list(t)[:r] for t, r in zip(tokens, room.tolist())]
    lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
    flat = np.fromiter((t for part in kept for t in part), dtype=np.int32, count=int(lengths.sum()))
    versions = np.repeat(last_versions(dock, rows, default_version), lengths)
    dock.responses.append(rows, lengths, {"tokens": flat, "logprobs": 0.0, "versions": versions, "mask": 0})
    dock.awaiting_tool[rows] = False
    full = dock.responses.length[rows] >= np.minimum(dock.max_tokens, dock.max_model_len - dock.prompt_lengths(rows))
    if full.any():
        end_episodes(dock, rows[full], stopped=False)
    return lengths


def trajectory(dock, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(response tokens int32[L], loss mask uint8[L]) of one row."""
    rows = np.asarray([row], dtype=np.int64)
    tokens = dock.responses.gather(rows, "tokens").copy()
    return tokens, dock.responses.gather(rows, "mask").copy() if dock.multi_turn else np.ones(len(tokens), np.uint8)


def turn_tail(tokens: np.ndarray, mask: np.ndarray, count: int) -> list[int]:
    """The last `count` tokens of the current turn: policy tokens after the last observation token."""
    observed = np.flatnonzero(mask == 0)
    start = int(observed[-1]) + 1 if len(observed) else 0
    return tokens[max(start, len(tokens) - count):].tolist()
