"""The multi-turn driver (rollout.env_path set): trajectories of policy turns and tool calls over the transfer dock.

Rounds, as the single-turn drivers (sync: up to max_tokens // max_split new tokens per request; async: the whole
remaining budget, and the engines abort once the dock is ready). Each round sends the rows that can generate (not
complete, not waiting for a tool); each answer is written to the dock as it arrives (rollout/requests.Generator's
on_result). An answer that ends on a tool-call stop string (finish_reason {"type": "stop", "matched": s} with s in
rollout.tool_call_stop, or a stop string split by a partial-rollout cut: spillover.rollout.tools.env.find_stop) starts its
env step at once on the env pool (rollout/tools/env_pool.py: bounded concurrency, a time limit); its observation is
tokenized, capped (rollout.max_tool_output_tokens) and appended with loss mask 0 when it arrives, and the row joins
the next round. A trajectory ends on EOS / a rollout.stop string, when the env says done, when a tool call would
open turn max_turns + 1, or when it fills max_tokens (which counts the whole trajectory, tool tokens included).

The dock's readiness check stops generation as in single-turn mode. Then every step still running is cut: a result
that has arrived is kept, one that has not is cancelled, its env dropped, and the row stays `awaiting_tool`: the
next iteration (or a resumed run) asks again, rebuilding the env by reset + replay. With seeded sampling
(rollout.deterministic_sampling) and a deterministic env, a trajectory cut anywhere and continued equals an uncut
one token for token.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Callable

import numpy as np

from spillover.rollout.dock import turns as dock_turns
from spillover.rollout.tools.env_pool import EnvPool
from spillover.rollout.drivers.requests import (GenerationStats, Generator, SamplingSettings, build_requests, parse_responses,
                              request_seeds)
from spillover.rollout.sample import Sample
from spillover.rollout.tools.env import ToolOutcome, find_stop, observation_tokens, split_actions, stop_window

log = logging.getLogger(__name__)


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


class _Trajectories:
    """One generate_until_ready call: the rows of the running round, the env calls in flight, the cut."""

    def __init__(self, dock, envs: EnvPool, tokenizer, rollout_cfg, weight_version: int, stats: GenerationStats,
                 tools: ToolStats, iteration: int, stop_when_ready: bool):
        self.dock, self.envs, self.tokenizer, self.cfg = dock, envs, tokenizer, rollout_cfg
        self.weight_version, self.stats, self.tools, self.iteration = weight_version, stats, tools, iteration
        self.stop_when_ready, self.stopping = stop_when_ready, False
        self.stops = tuple(rollout_cfg.tool_call_stop)
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.finished: collections.deque = collections.deque()  # rows whose call is done (appended by any thread)
        self.rows, self.written = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        self.on_progress: Callable[[], None] = lambda: None

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

    # ---- answers (on the engine's callback thread while the caller waits in generate) -----------------------
    def on_result(self, index: int, response: dict) -> bool:
        if self.written[index]:
            return False  # a retried request answered twice: keep the first
        row = int(self.rows[index])
        tokens, logprobs, stopped, version = parse_responses([response], self.weight_version)
        new, lps = tokens[0], logprobs[0]
        reason = response["meta_info"].get("finish_reason") or {}
        tool = reason.get("type") == "stop" and reason.get("matched") in self.stops
        if not tool and new and self.dock.responses.length[row] > 0:
            before, mask = dock_turns.trajectory(self.dock, row)
            cut = find_stop(dock_turns.turn_tail(before, mask, stop_window(self.stops)), new, self.stops, self.decode)
            if cut is not None:
                new, lps, tool = new[:cut], lps[:cut], True
        if tool:
            stopped[:] = False
        self.dock.put_generation(self.rows[index:index + 1], [new], [lps], version, stopped)
        self.written[index] = True
        self.stats.tokens_generated += len(new)
        if tool and not self.dock.complete[row]:
            self.tool_call(row)
        self.apply_finished()
        stop = self.stop_when_ready and not self.stopping and bool(self.dock.update_ready())
        self.stopping |= stop
        self.on_progress()
        return stop

    def tool_call(self, row: int) -> None:
        if self.dock.turns[row] + 1 >= self.cfg.max_turns:  # this was the last turn allowed
            dock_turns.end_episodes(self.dock, [row], stopped=False)
            return
        dock_turns.begin_tool_calls(self.dock, [row])
        if not self.stopping:  # once the round stops, the call waits for the next iteration (awaiting_tool)
            self.start_step(row)

    def start_step(self, row: int) -> None:
        """The row's pending tool call (its turns-th action, parsed from its tokens) goes to the env pool."""
        tokens, mask = dock_turns.trajectory(self.dock, row)
        k, key = int(self.dock.turns[row]), self.key(row)
        observed = np.flatnonzero(mask == 0)
        turn_start = int(observed[-1]) + 1 if len(observed) else 0
        current = split_actions(tokens[turn_start:], mask[turn_start:], self.stops, self.decode)
        history = None
        if not self.envs.has(key, k - 1) or len(current) != 1:
            actions = split_actions(tokens, mask, self.stops, self.decode)
            if len(actions) < k:
                log.warning("row %s: %d tool calls in its tokens but %d counted; the episode ends", key,
                            len(actions), k)
                dock_turns.end_episodes(self.dock, [row], stopped=False)
                return
            history, action = actions[:k - 1], actions[k - 1]
        else:
            action = current[0]
        sample = self.sample(row) if history is not None else None
        future = self.envs.step(key, sample, history, action, self.iteration)
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
            self.tools.record(outcome, step)
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

    # ---- between rounds (the calling thread) ---------------------------------------------------------------
    def restart_pending(self) -> None:
        """Rows carried over (or restored) with a tool call pending ask for it again."""
        for row in np.flatnonzero(self.dock.awaiting_tool & ~self.dock.complete).tolist():
            if row not in self.pending:
                self.start_step(row)

    def reset_new(self, rows: np.ndarray) -> np.ndarray:
        """Taken rows that have no env yet (a new trajectory) get one: their first observation is appended (mask 0);
        rows that it ends go back. -> the rows to generate."""
        fresh = [row for row in rows.tolist() if self.dock.responses.length[row] == 0 and self.dock.turns[row] == 0
                 and not self.envs.has(self.key(row), 0)]
        if not fresh:
            return rows
        futures = [self.envs.reset(self.key(row), self.sample(row)) for row in fresh]
        self.apply(fresh, [f.result() for f in futures], step=False)
        ended = rows[self.dock.complete[rows]]
        if len(ended):
            self.dock.release(ended)
        return rows[~self.dock.complete[rows]]

    def wait_for_a_tool(self) -> None:
        concurrent.futures.wait(list(self.pending.values()), timeout=self.cfg.tool_timeout_s + 5.0,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def run_round(self, engine: Generator, rows: np.ndarray, sampling: SamplingSettings,
                  round_tokens: int | None) -> None:
        inputs, max_new = self.dock.generation_inputs(rows, round_tokens)
        requests = build_requests(inputs, max_new, sampling, request_seeds(self.dock, rows, sampling))
        self.rows, self.written = rows, np.zeros(len(rows), dtype=bool)
        self.stats.rounds += 1
        self.stats.requests += len(rows)
        start = time.perf_counter()
        try:
            engine.generate(requests, on_result=self.on_result)
        finally:
            self.stats.engine_s += time.perf_counter() - start
            left = self.rows[~self.written]
            self.written[:] = True
            if len(left):
                self.dock.release(left)  # rows whose answer never came go back untouched

    def cut(self) -> None:
        """The end of generation: arrived results are kept; calls still running are cancelled (their rows stay
        awaiting_tool and their envs are rebuilt when asked again)."""
        for row, future in list(self.pending.items()):
            if not future.done() and future.cancel():
                self.pending.pop(row)
                self.envs.discard(self.key(row))
        self.finished.extend(self.pending)  # every call left has finished (its callback may still be on its way)
        self.apply_finished()


def generate_until_ready_multi_turn(dock, engine: Generator, rollout_cfg, sampling: SamplingSettings,
                                    weight_version: int, drain: bool, on_round: Callable[[dict], None] | None,
                                    envs: EnvPool, tokenizer, iteration: int = 0) -> tuple[GenerationStats, ToolStats]:
    """Generate multi-turn trajectories until >= GBS groups are ready (drain: every row complete)."""
    dock.set_drain(drain)
    stats, tools, start = GenerationStats(), ToolStats(), time.perf_counter()
    sampling = dataclasses.replace(sampling, stop=tuple(sampling.stop) + tuple(rollout_cfg.tool_call_stop))
    asynchronous = rollout_cfg.mode == "async"
    round_tokens = None if asynchronous else rollout_cfg.max_tokens // rollout_cfg.max_split
    rows_per_round = None if asynchronous else ((rollout_cfg.global_batch_size + rollout_cfg.over_sampling_groups)
                                                * rollout_cfg.n_samples_per_prompt)
    run = _Trajectories(dock, envs, tokenizer, rollout_cfg, weight_version, stats, tools, iteration, asynchronous)
    last_report = [0.0]

    def progress(force: bool = False) -> None:
        now = time.perf_counter()
        if on_round and (force or now - last_report[0] > 0.5):
            last_report[0] = now
            on_round({"round": stats.rounds, "ready_groups": dock.ready_group_count(),
                      "target_groups": rollout_cfg.global_batch_size, "tokens": stats.tokens_generated,
                      "elapsed_s": now - start})
    run.on_progress = progress
    occupied = np.flatnonzero(np.repeat(dock.group_ids >= 0, dock.n))
    envs.keep_only({run.key(row) for row in occupied.tolist()})
    rebuilds = envs.rebuilds
    try:
        run.restart_pending()
        while True:
            run.apply_finished()
            if dock.update_ready():
                break
            rows = run.reset_new(dock.take_rows(limit=rows_per_round))
            if len(rows):
                run.run_round(engine, rows, sampling, round_tokens)
                progress(force=not asynchronous)
            elif run.pending:
                run.wait_for_a_tool()
            else:
                raise RuntimeError(f"generation cannot finish: no row left to generate and no tool call running, but "
                                   f"only {dock.ready_group_count()} groups are ready (need {dock.gbs})")
    finally:
        run.cut()
    tools.rebuilds = envs.rebuilds - rebuilds
    tools.carried_mid_tool = int((np.repeat(dock.group_ids >= 0, dock.n) & dock.awaiting_tool).sum())
    stats.ready_groups = dock.ready_group_count()
    stats.time_s = time.perf_counter() - start
    return stats, tools
