"""The generation driver: rounds of requests over the transfer dock until it is ready, one loop for every mode.

    stats = generate_rounds(dock, fleet, rollout_cfg, sampling, weight_version, drain, on_round, hooks)

Each round takes rows from the dock (carried-over rows first, oldest first; spillover.rollout.drivers.dispatch orders
and pins them), sends them with the mode's budget (RoundBudget) and writes the answers into the dock:
- sync: rounds of (GBS + over_sampling_groups) x n rows, up to max_tokens // max_split new tokens per row, until the
  dock is ready (>= GBS groups complete; drain: every row). The over-sampled groups go out from the first round
  (APRIL). With max_split = 1 a round generates whole responses: plain GRPO. A round's answers are written at once
  when it ends (one dock call for all rows), unless the hooks want each as it arrives.
- async: every row that can generate, with its whole remaining budget; each answer is written as it arrives (the
  Fleet's on_result), and the one that finds the dock ready stops the round (the engines abort); the partial
  tokens that come back stay in the dock for the next iteration. The check runs on every answer (finer than
  MindSpeed's "every 20 engine steps": it costs microseconds).

- overlap (rollout.overlap, async mode): the answer that finds the dock ready detaches the round instead: the
  requests still running go on through reward, logprobs, update, clear and checkpoint, their rows stay in flight (so
  no round dispatches them again), and their answers (DetachedRows) are written at the start of the next call, by
  this thread and the same write path: the dock keeps one writer and no lock. Waiting answers are lost to a kill -9
  (the checkpoint holds the rows as they were when the round detached): they are generated again.

RoundHooks is what a rollout adds to the loop (the defaults are single-turn generation; ToolTurns in
rollout/drivers/tool_turns.py makes trajectories of turns and tool calls). Answers are written by callbacks that run
one at a time (on the engine's loop) while the calling thread waits in `generate`, and rows left unanswered go back
after it returns, so the dock is only ever touched by one thread at a time.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from ...infra.config.rollout import RolloutConfig
from ..dock.transfer_dock import TransferDock
from .dispatch import DispatchPlanner
from ..contracts.fleet import Fleet
from .requests import (GenerationStats, SamplingSettings, build_requests,
                       parse_responses, request_seeds)
from ..sglang.protocol import GenerateResponse
from ..stop_strings import Decode, completing_token, stop_window

OnRound = Callable[[dict], None]
"""on_round(progress): round, ready_groups, target_groups, tokens, elapsed_s (the terminal and Prefect progress)."""
PROGRESS_INTERVAL_S = 0.5  # progress from inside a round, at most this often


@dataclasses.dataclass(frozen=True)
class RoundBudget:
    tokens: int | None      # new tokens per row and round; None: each row's whole remaining budget
    rows: int | None        # rows per round; None: every row that can generate
    stop_when_ready: bool   # the answer that finds the dock ready stops the round (every engine aborts)

    @classmethod
    def for_mode(cls, rollout_cfg: RolloutConfig) -> "RoundBudget":
        if rollout_cfg.mode == "async":
            return cls(tokens=None, rows=None, stop_when_ready=True)
        rows = (rollout_cfg.global_batch_size + rollout_cfg.over_sampling_groups) * rollout_cfg.n_samples_per_prompt
        return cls(tokens=rollout_cfg.max_tokens // rollout_cfg.max_split, rows=rows, stop_when_ready=False)


class DetachedRows:
    """The rows of the engine call that generate_rounds left running (rollout.overlap) until the next call collects
    their answers; one per dock, kept by the caller as long as the run."""

    def __init__(self):
        self.rows = np.zeros(0, dtype=np.int64)   # the detached call's rows, in its request order
        self.pending = np.zeros(0, dtype=np.int64)  # indices into rows still running
        self.version = 0                          # the weight version they were sent under

    def hold(self, rows: np.ndarray, pending: np.ndarray, version: int = 0) -> None:
        self.rows, self.pending, self.version = rows, pending, version

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """-> (rows, pending) and forget them."""
        out = self.rows, self.pending
        self.hold(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        return out


class RoundHooks:
    """What a rollout adds to the driver loop; these defaults are single-turn generation.

    on_start / on_end run once per generate_rounds call (on_end also after a failure); between_rounds before each
    readiness check; before_round on the rows taken for a round; on_answers with answers as they arrive (on the
    engine's callback thread: async mode, or answers_as_they_arrive) or with all of a round's once it ends (sync);
    wait_for_rows when no row can generate although the dock is not ready."""

    stop_strings: tuple[str, ...] = ()  # stop strings the hooks need besides rollout.stop
    answers_as_they_arrive = False      # on_answers with each answer as it arrives, in sync mode too

    def __init__(self, dock: TransferDock, weight_version: int, stop: Sequence[str] = (), decode: Decode | None = None):
        """stop (rollout.stop) and decode (the tokenizer's): a row ends where a stop string completes though the
        engine did not end it there (split by a partial-rollout cut, or completed by an aborted answer's last token:
        spillover.rollout.stop_strings)."""
        if stop and decode is None:
            raise ValueError("stop strings (rollout.stop) need the tokenizer's decode to be matched across "
                             "partial-rollout cuts: RoundHooks(..., decode=tokenizer.decode)")
        self.dock, self.weight_version = dock, weight_version
        self.stop, self.stop_decode = tuple(stop), decode

    def on_start(self) -> None:
        pass

    def between_rounds(self) -> None:
        pass

    def before_round(self, rows: np.ndarray) -> np.ndarray:
        """In-flight rows taken for the round -> bool[k]: the rows to send (the hook released the others)."""
        return np.ones(len(rows), dtype=bool)

    def on_answers(self, rows: np.ndarray, answers: list[GenerateResponse], stopping: bool) -> int:
        """Write the rows' answers into the dock (stopping: an earlier answer stopped the round) -> new tokens kept."""
        tokens, logprobs, stopped, version = parse_responses(answers, self.weight_version)
        if self.stop:
            self.end_at_unseen_stops(rows, tokens, logprobs, stopped, version)
        self.dock.put_generation(rows, tokens, logprobs, version, stopped, current_version=self.weight_version)
        return sum(len(t) for t in tokens)

    def end_at_unseen_stops(self, rows: np.ndarray, tokens: list[list[int]], logprobs: list[list[float]],
                            stopped: np.ndarray, version: np.ndarray | list[np.ndarray]) -> None:
        """In place: each answer is cut after the token that completes a stop string the engine did not see, and
        marked stopped. Also an answer the engine stopped: one that ran on past a string split by the cut usually
        ends later at an EOS of its own."""
        window = stop_window(self.stop)
        for i, row in enumerate(rows.tolist()):
            if not tokens[i]:
                continue
            before = self.dock.responses.gather(np.asarray([row]), "tokens")[-window:].tolist()
            k = completing_token(before, tokens[i], self.stop, self.stop_decode)
            if k is not None:
                tokens[i], logprobs[i], stopped[i] = tokens[i][:k], logprobs[i][:k], True
                if isinstance(version, list):  # one version per token (it lived through an update)
                    version[i] = version[i][:k]

    def wait_for_rows(self) -> bool:
        """No row can generate: wait until one may (True), or say that none ever will (False)."""
        return False

    def on_end(self) -> None:
        pass


class _Progress:
    def __init__(self, dock: TransferDock, on_round: OnRound | None, target_groups: int, stats: GenerationStats):
        self.dock, self.on_round, self.target_groups, self.stats = dock, on_round, target_groups, stats
        self.start = time.perf_counter()
        self.last = 0.0

    def report(self, force: bool) -> None:
        now = time.perf_counter()
        if self.on_round and (force or now - self.last > PROGRESS_INTERVAL_S):
            self.last = now
            self.on_round({"round": self.stats.rounds, "ready_groups": self.dock.ready_group_count(),
                           "target_groups": self.target_groups, "tokens": self.stats.tokens_generated,
                           "elapsed_s": now - self.start})


class _Round:
    """One engine call: its answers into the dock, each as it arrives or all once the call returns; stops the round
    once the dock is ready (stop_when_ready)."""

    def __init__(self, dock: TransferDock, rows: np.ndarray, hooks: RoundHooks, budget: RoundBudget,
                 stats: GenerationStats, progress: _Progress):
        self.dock, self.rows, self.hooks, self.budget = dock, rows, hooks, budget
        self.stats, self.progress = stats, progress
        self.as_they_arrive = budget.stop_when_ready or hooks.answers_as_they_arrive
        self.answers: list[GenerateResponse | None] = [None] * len(rows)
        self.written = np.zeros(len(rows), dtype=bool)
        self.stopping = False

    def on_result(self, index: int, answer: GenerateResponse) -> bool:
        """True (stop the round) from the answer that finds the dock ready, with stop_when_ready."""
        if self.answers[index] is not None:
            return False  # an engine restart may deliver a retried request twice: keep the first
        self.answers[index] = answer
        if not self.as_they_arrive:
            return False
        self.write(np.asarray([index]))
        stop = self.budget.stop_when_ready and not self.stopping and bool(self.dock.update_ready())
        self.stopping |= stop
        if self.budget.stop_when_ready and not self.stopping:
            self.progress.report(force=False)
        # the stopping answer reports after the round (generate_rounds): every millisecond spent here before the
        # engines hear the abort lets the rows still decoding finish instead of being cut
        return stop

    def write(self, indices: np.ndarray) -> None:
        if len(indices):
            self.stats.tokens_generated += self.hooks.on_answers(self.rows[indices],
                                                                [self.answers[i] for i in indices], self.stopping)
            self.written[indices] = True

    def write_the_rest(self) -> None:
        """After the engine call returned: the answers not written yet (all of them, when they were kept)."""
        self.write(np.asarray([i for i, a in enumerate(self.answers) if a is not None and not self.written[i]],
                              dtype=np.int64))

    def detach(self, detached: DetachedRows) -> None:
        """The round stopped with requests still running (overlap): their rows stay in flight until collected."""
        pending = np.flatnonzero(~self.written & self.dock.in_flight[self.rows])
        detached.hold(self.rows, pending, self.hooks.weight_version)
        self.written[pending] = True

    def release_unanswered(self) -> None:
        """Rows whose answer never came (or could not be written) go back untouched."""
        left = self.rows[~self.written & self.dock.in_flight[self.rows]]
        self.written[:] = True
        if len(left):
            self.dock.release(left)


def generate_rounds(dock: TransferDock, fleet: Fleet, rollout_cfg: RolloutConfig, sampling: SamplingSettings,
                    weight_version: int, drain: bool = False, on_round: OnRound | None = None,
                    hooks: RoundHooks | None = None, detached: DetachedRows | None = None,
                    decode: Decode | None = None) -> GenerationStats:
    """Rounds with rollout.mode's budget until >= GBS groups are ready (drain: every loaded row complete).

    detached (needed with rollout.overlap): the answers of the requests the previous call left running are written
    first, and this call's round that finds the dock ready leaves its running requests there. decode (the
    tokenizer's; needed with sampling.stop and no hooks): for the default hooks' stop strings across cuts."""
    if rollout_cfg.overlap and detached is None:
        raise ValueError("rollout.overlap=true: generate_rounds needs a DetachedRows kept for the run (detached=...), "
                         "where the requests left running wait for the next call")
    budget = RoundBudget.for_mode(rollout_cfg)
    hooks = hooks or RoundHooks(dock, weight_version, sampling.stop, decode)
    if hooks.stop_strings:
        sampling = dataclasses.replace(sampling, stop=tuple(sampling.stop) + tuple(hooks.stop_strings))
    dock.set_drain(drain)
    stats = GenerationStats()
    progress = _Progress(dock, on_round, rollout_cfg.global_batch_size, stats)
    planner = DispatchPlanner.from_config(rollout_cfg, fleet, weight_version, drain)
    # rollout.adopt_detached: requests still running from the last call join this call's first round; a request
    # reuses only prefixes cached under its own weight version
    adopt = detached is not None and rollout_cfg.adopt_detached
    cache_key = f"weights-v{weight_version}" if adopt else None
    adopted = np.zeros(0, dtype=np.int64)
    try:
        hooks.on_start()
        if detached is not None:
            adopted = _collect_detached(dock, fleet, detached, hooks, budget, stats, progress, adopt)
        while True:
            hooks.between_rounds()
            ready = dock.update_ready()
            # overlap: a dock that is ready before this call sent anything still sends its open rows, detached at
            # once, so that they generate through the update instead of leaving the engines idle in it
            at_once = ready and detached is not None and stats.rounds == 0
            if ready and not at_once:
                break
            rows, engines = planner.next_rows(dock, limit=budget.rows)
            if len(rows) == 0 and len(adopted) == 0:
                if at_once:
                    break
                if hooks.wait_for_rows():
                    continue
                raise RuntimeError(f"generation cannot finish: no row left to generate (and no tool call running), "
                                   f"but only {dock.ready_group_count()} groups are ready (need {dock.gbs})")
            if len(rows):
                keep = hooks.before_round(rows)
                rows, engines = rows[keep], None if engines is None else engines[keep]
            if len(rows) or len(adopted):
                stopped = _run_round(dock, fleet, rows, engines, planner, sampling, budget, hooks, stats, progress,
                                     detached, at_once, adopted, cache_key)
                adopted = adopted[:0]
                progress.report(force=stopped or at_once or not budget.stop_when_ready)
            if at_once:
                break
    finally:
        try:
            planner.release_held(dock)
        finally:
            hooks.on_end()
    stats.ready_groups = dock.ready_group_count()
    stats.time_s = time.perf_counter() - progress.start
    return stats


def _run_round(dock: TransferDock, fleet: Fleet, rows: np.ndarray, engines: np.ndarray | None,
               planner: DispatchPlanner, sampling: SamplingSettings, budget: RoundBudget, hooks: RoundHooks,
               stats: GenerationStats, progress: _Progress, detached: DetachedRows | None,
               at_once: bool = False, adopted: np.ndarray | None = None, cache_key: str | None = None) -> bool:
    """One engine call over `rows` -> whether an answer found the dock ready and stopped it. at_once (overlap, the
    dock ready already): the call returns at once and every request runs on, detached. adopted: the rows of the
    requests the fleet adopted from the last call (its answers len(rows) + k); cache_key: the requests' extra_key."""
    jobs = []
    if len(rows):
        inputs, max_new = dock.generation_inputs(rows, budget.tokens)
        requests = build_requests(inputs, max_new, sampling, request_seeds(dock, rows, sampling), cache_key)
        jobs = planner.route(requests, engines, planner.cutoff_groups(dock, rows))
    if adopted is not None and len(adopted):
        rows = np.concatenate([rows, adopted])
    round_ = _Round(dock, rows, hooks, budget, stats, progress)
    stats.rounds += 1
    stats.requests += len(jobs)
    start = time.perf_counter()
    try:
        try:
            if detached is None:
                fleet.generate(jobs, on_result=round_.on_result)
            elif at_once:
                fleet.generate(jobs, detach=True)
            else:
                fleet.generate(jobs, on_result=round_.on_result, detach=True)
        finally:
            stats.engine_s += time.perf_counter() - start
        round_.write_the_rest()
        if detached is not None and (round_.stopping or at_once):
            round_.detach(detached)
    finally:
        round_.release_unanswered()
    return round_.stopping


def _collect_detached(dock: TransferDock, fleet: Fleet, detached: DetachedRows, hooks: RoundHooks,
                      budget: RoundBudget, stats: GenerationStats, progress: _Progress,
                      adopt: bool = False) -> np.ndarray:
    """The previous call's detached answers into the dock (what still runs is aborted with its tokens so far); rows
    without an answer go back untouched. adopt: what still runs is left running (the fleet adopts it into the next
    generate call); -> the rows of those requests, in flight, in the order the fleet numbers them."""
    version = detached.version
    rows, pending = detached.take()
    start = time.perf_counter()
    try:
        answers = fleet.collect_detached(adopt=adopt)
    except BaseException:  # a request failed (the fleet raises its error): the rows go back untouched
        dock.release(rows[pending[dock.in_flight[rows[pending]]]])
        raise
    finally:
        stats.engine_s += time.perf_counter() - start
    running = np.zeros(0, dtype=np.int64)
    if adopt:
        running = np.asarray([i for i in pending.tolist() if i not in answers], dtype=np.int64)
        pending = pending[~np.isin(pending, running)]
        if len(running):  # their tokens come later: the staleness bound counts them from now
            dock.adopt_in_flight(rows[running], version, hooks.weight_version)
            stats.adopted_requests += len(running)
    if not len(pending):
        return rows[running]
    round_ = _Round(dock, rows[pending], hooks, dataclasses.replace(budget, stop_when_ready=False), stats, progress)
    try:
        for k, index in enumerate(pending.tolist()):
            if index in answers:
                round_.answers[k] = answers[index]
        before = stats.tokens_generated
        round_.write_the_rest()
        stats.detached_tokens += stats.tokens_generated - before
    finally:
        round_.release_unanswered()
    return rows[running]
