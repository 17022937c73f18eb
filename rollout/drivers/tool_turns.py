"""Multi-turn tool use (rollout.env_path set): ToolTurns, the driver's hooks (rollout/drivers/rounds.py) that make
each row a trajectory of policy turns and tool calls over the transfer dock.

Rounds as in single-turn mode (sync: up to max_tokens // max_split new tokens per request; async: the whole remaining
budget, and the engines abort once the dock is ready), sending the rows that can generate (not complete, not waiting
for a tool). An answer that ends on a tool-call stop string (finish_reason {"type": "stop", "matched": s} with s in
rollout.tool_call_stop, or a stop string split by a partial-rollout cut: spillover.rollout.stop_strings)
starts its env step at once on the env pool (rollout/tools/env_pool.py: bounded concurrency, a time limit), on the
engine's event loop (RolloutManager.loop, where the answers arrive), so tool calls overlap generation; its observation
is tokenized, capped (rollout.max_tool_output_tokens) and appended with loss mask 0 between rounds once it has arrived,
and the row joins the next round. A trajectory ends on EOS / a rollout.stop string, when the env says done, when a
tool call would open turn max_turns + 1, or when it fills max_tokens (which counts the whole trajectory, tool tokens
included).

The dock's readiness check stops generation as in single-turn mode. Then every step still running is cut: a result
that has arrived is kept, one that has not is cancelled, its env dropped, and the row stays `awaiting_tool`: the
next iteration (or a resumed run) asks again, rebuilding the env by reset + replay. With seeded sampling
(rollout.deterministic_sampling) and a deterministic env, a trajectory cut anywhere and continued equals an uncut
one token for token.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import TypeVar

import numpy as np

from ...infra.config.rollout import RolloutConfig
from ..batch import RolloutBatch
from ..dock import turns as dock_turns
from ..dock.transfer_dock import TransferDock
from .requests import parse_responses
from .rounds import RoundHooks
from ..sglang.protocol import GenerateResponse
from ..sample import Sample
from ..stop_strings import completing_token, stop_window
from ..tools.env import ToolOutcome, observation_tokens, split_actions
from ..tools.env_pool import EnvPool

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class ToolStats:
    calls: int = 0         # env.step calls whose outcome reached the dock (replays not counted)
    errors: int = 0        # of those and of resets: raised, timed out or returned a bad value
    timeouts: int = 0
    resets: int = 0
    latencies_s: list = dataclasses.field(default_factory=list)
    rebuilds: int = 0      # envs rebuilt by reset + replay (a restart, or a call cut off)
    carried_mid_tool: int = 0

    def record(self, outcome: ToolOutcome, step: bool) -> None:
        self.calls += step
        self.resets += not step
        self.errors += outcome.error
        self.timeouts += outcome.timed_out
        if step:
            self.latencies_s.append(outcome.latency_s)

    def as_dict(self) -> dict:
        lat = np.asarray(self.latencies_s, dtype=np.float64)
        return {"tool_calls": self.calls, "tool_errors": self.errors, "tool_timeouts": self.timeouts,
                "tool_latency_p50": float(np.percentile(lat, 50)) if len(lat) else 0.0,
                "tool_latency_p99": float(np.percentile(lat, 99)) if len(lat) else 0.0,
                "tool_env_rebuilds": self.rebuilds, "carried_mid_tool": self.carried_mid_tool}


class ToolTurns(RoundHooks):
    """The hooks of one generate_rounds call: the env calls in flight and the cut at its end.

    loop: the engine's event loop (RolloutManager.loop), where the answers arrive and the env calls run."""

    answers_as_they_arrive = True  # a tool call starts as soon as its turn's answer is in

    def __init__(self, dock: TransferDock, weight_version: int, rollout_cfg: RolloutConfig, envs: EnvPool, tokenizer,
                 loop: asyncio.AbstractEventLoop, iteration: int = 0):
        super().__init__(dock, weight_version, rollout_cfg.stop, self.decode)
        self.envs, self.tokenizer, self.cfg, self.loop, self.iteration = envs, tokenizer, rollout_cfg, loop, iteration
        self.stop_strings = tuple(rollout_cfg.tool_call_stop)
        self.stats = ToolStats()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.finished: collections.deque = collections.deque()  # rows whose call is done (appended on the loop)
        self.rebuilds_before = 0

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def key(self, row: int) -> tuple[int, int]:
        return int(self.dock.group_ids[row // self.dock.n]), int(row % self.dock.n)

    def sample(self, row: int) -> Sample:
        """What env.reset sees: the prompt (tokens and text), label and data.additional_keys of the row's group."""
        dock, slot = self.dock, row // self.dock.n
        prompt = dock.prompts.gather(np.asarray([slot]), "tokens").tolist()
        gid, i = self.key(row)
        return Sample(group_index=gid, index=gid * dock.n + i, prompt_tokens=prompt, label=dock.labels[slot],
                      prompt=self.tokenizer.decode(prompt, skip_special_tokens=True),
                      metadata={"data": dock.metadata[slot]} if dock.metadata[slot] is not None else {})

    def submit(self, call: Coroutine[None, None, T]) -> concurrent.futures.Future:
        """Run an env call on the engine's loop (from any thread, that loop's own included) without waiting."""
        return asyncio.run_coroutine_threadsafe(call, self.loop)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """fn() on the engine's loop, where the env calls touch the pool's envs; waits (never from that loop)."""
        async def call() -> T:
            return fn()
        return self.submit(call()).result()

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def on_start(self) -> None:
        occupied = np.flatnonzero(np.repeat(self.dock.group_ids >= 0, self.dock.n))
        keys = {self.key(row) for row in occupied.tolist()}
        self.on_loop(lambda: self.envs.keep_only(keys))
        self.rebuilds_before = self.envs.rebuilds
        for row in np.flatnonzero(self.dock.awaiting_tool & ~self.dock.complete).tolist():
            self.start_step(row)  # carried over (or restored) with a tool call pending: ask for it again

    def between_rounds(self) -> None:
        self.apply_finished()

    def before_round(self, rows: np.ndarray) -> np.ndarray:
        """Taken rows that have no env yet (a new trajectory) get one: their first observation is appended (mask 0);
        rows that it ends go back."""
        fresh = [row for row in rows.tolist() if self.dock.responses.length[row] == 0 and self.dock.turns[row] == 0
                 and not self.envs.has(self.key(row), 0)]
        if not fresh:
            return np.ones(len(rows), dtype=bool)
        futures = [self.submit(self.envs.reset(self.key(row), self.sample(row))) for row in fresh]
        self.apply(fresh, [f.result() for f in futures], step=False)
        ended = rows[self.dock.complete[rows]]
        if len(ended):
            self.dock.release(ended)
        return ~self.dock.complete[rows]

    def on_answers(self, rows: np.ndarray, answers: list[GenerateResponse], stopping: bool) -> int:
        return sum(self.on_answer(int(row), answer, stopping) for row, answer in zip(rows.tolist(), answers))

    def on_answer(self, row: int, answer: GenerateResponse, stopping: bool) -> int:
        """The answer into the dock, cut after a tool call's stop string (or ended after a rollout.stop string); a tool
        call starts (unless the round stops) and outcomes that have arrived are applied. -> new tokens kept."""
        tokens, logprobs, stopped, version = parse_responses([answer], self.weight_version)
        new, lps = tokens[0], logprobs[0]
        reason = answer.meta_info.finish_reason
        tool = reason.type == "stop" and reason.matched in self.stop_strings
        if not tool and new:  # a tool call's or the answer's (rollout.stop) stop string the engine did not see
            before, mask = dock_turns.trajectory(self.dock, row)
            window = dock_turns.turn_tail(before, mask, stop_window(self.stop_strings + self.stop))
            call = completing_token(window, new, self.stop_strings, self.decode)
            end = completing_token(window, new, self.stop, self.decode) if self.stop else None
            cut, tool = (end, False) if end is not None and (call is None or end <= call) else (call, call is not None)
            if cut is not None:
                new, lps = new[:cut], lps[:cut]
                stopped[:] = not tool
                if isinstance(version, list):  # one version per token (it lived through an update): cut them too
                    version = [version[0][:cut]]
        if tool:
            stopped[:] = False
        self.dock.put_generation(np.asarray([row]), [new], [lps], version, stopped)
        if tool and not self.dock.complete[row]:
            self.tool_call(row, stopping)
        self.apply_finished()
        return len(new)

    def wait_for_rows(self) -> bool:
        if not self.pending:
            return False
        concurrent.futures.wait(list(self.pending.values()), timeout=self.cfg.tool_timeout_s + 5.0,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    def on_end(self) -> None:
        """The end of generation: arrived results are kept; calls still running are cancelled (their rows stay
        awaiting_tool and their envs are rebuilt when asked again)."""
        for row, future in list(self.pending.items()):
            if not future.done() and future.cancel():
                self.pending.pop(row)
                key = self.key(row)
                self.on_loop(lambda key=key: self.envs.discard(key))
        self.finished.extend(self.pending)  # every call left has finished (its callback may still be on its way)
        self.apply_finished()
        self.stats.rebuilds = self.envs.rebuilds - self.rebuilds_before
        occupied = np.repeat(self.dock.group_ids >= 0, self.dock.n)
        self.stats.carried_mid_tool = int((occupied & self.dock.awaiting_tool).sum())

    # ---- tool calls --------------------------------------------------------------------------------------------
    def tool_call(self, row: int, stopping: bool) -> None:
        if self.dock.turns[row] + 1 >= self.cfg.max_turns:  # this was the last turn allowed
            dock_turns.end_episodes(self.dock, [row], stopped=False)
            return
        dock_turns.begin_tool_calls(self.dock, [row])
        if not stopping:  # once the round stops, the call waits for the next iteration (awaiting_tool)
            self.start_step(row)

    def start_step(self, row: int) -> None:
        """The row's pending tool call (its turns-th action, parsed from its tokens) goes to the env pool."""
        tokens, mask = dock_turns.trajectory(self.dock, row)
        k, key = int(self.dock.turns[row]), self.key(row)
        observed = np.flatnonzero(mask == 0)
        turn_start = int(observed[-1]) + 1 if len(observed) else 0
        current = split_actions(tokens[turn_start:], mask[turn_start:], self.stop_strings, self.decode)
        history = None
        if not self.envs.has(key, k - 1) or len(current) != 1:
            actions = split_actions(tokens, mask, self.stop_strings, self.decode)
            if len(actions) < k:
                log.warning("row %s: %d tool calls in its tokens but %d counted; the episode ends", key,
                            len(actions), k)
                dock_turns.end_episodes(self.dock, [row], stopped=False)
                return
            history, action = actions[:k - 1], actions[k - 1]
        else:
            action = current[0]
        sample = self.sample(row) if history is not None else None
        future = self.submit(self.envs.step(key, sample, history, action, self.iteration))
        self.pending[row] = future
        future.add_done_callback(lambda _, row=row: self.finished.append(row))

    def apply_finished(self) -> None:
        """Outcomes that have arrived go into the dock: observation tokens (mask 0), rewards, episode ends."""
        futures = {}
        while self.finished:
            row = self.finished.popleft()
            if row in self.pending and self.pending[row].done():
                futures[row] = self.pending.pop(row)
        rows = [row for row, future in futures.items() if not future.cancelled()]
        self.apply(rows, [futures[row].result() for row in rows], step=True)

    def apply(self, rows: list[int], outcomes: list[ToolOutcome], step: bool) -> None:
        if not rows:
            return
        for outcome in outcomes:
            self.stats.record(outcome, step)
        cap = self.cfg.max_tool_output_tokens
        rows_arr = np.asarray(rows, dtype=np.int64)
        dock_turns.put_observations(self.dock, rows_arr, [observation_tokens(o.observation, self.tokenizer, cap)
                                                          for o in outcomes], self.weight_version)
        rewarded = [(row, o.reward) for row, o in zip(rows, outcomes) if o.reward is not None]
        if rewarded:
            dock_turns.set_env_rewards(self.dock, [r for r, _ in rewarded], [v for _, v in rewarded])
        for stopped in (True, False):
            ending = [row for row, o in zip(rows, outcomes) if o.done and o.error != stopped]
            ending = [row for row in ending if not self.dock.complete[row]]
            if ending:
                dock_turns.end_episodes(self.dock, ending, stopped=stopped)


def turn_metrics(batch: RolloutBatch) -> dict:
    """turns_mean / turns_max (model turns per trained trajectory: tool calls + 1) and tool_token_share (the trained
    response tokens that are tool output, loss mask 0)."""
    turns = (batch.turns if batch.turns is not None else np.zeros(len(batch), np.int32)) + 1
    tokens = len(batch.loss_mask)
    return {"turns_mean": float(turns.mean()) if len(turns) else 0.0,
            "turns_max": int(turns.max()) if len(turns) else 0,
            "tool_token_share": float((batch.loss_mask == 0).sum() / tokens) if tokens else 0.0}
