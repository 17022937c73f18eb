"""A simulated engine pool: RolloutManager's generation interface in virtual time instead of compute.

    engine = SimulatedEngine(EngineTiming(), LognormalLengths(n=16))
    answers = engine.generate(jobs, on_result=None)       # /generate answers, in input order
    on_result(index, answer) -> True                       # stop right there (as RolloutManager does)
    engine.abort_all()                                     # the same, called from an on_result callback
    engine.update_weights(None, version); engine.advance(seconds); engine.clock_s; engine.usage()
    engine.generate(jobs, on_result, detach=True)          # True from on_result: return, the rest keeps running
    engine.generate(jobs, detach=True)                     # no on_result: return at once, everything runs on
    engine.advance(s); engine.update_weights(None, v, pause_s); engine.collect_detached()   # {index: answer}
    engine.collect_detached(adopt=True)                    # the ended ones; the next generate adopts the others

Timing model (all in integer nanoseconds, so hand-computed cases are exact):
- `num_engines` engines with `slots_per_engine` slots each. Continuous batching: a request runs in a slot
  until it ends; queued requests (one FIFO for the pool, i.e. a load-aware router) take slots as they free.
  The first fill goes round robin over the engines.
- Every engine steps on its own clock. One decode step costs `step_base_s + step_per_seq_s x active`
  and gives every active request one token. The step in which requests are admitted also costs
  `prefill_per_token_s x their input length` (prompt + partial response: a continued row is re-prefilled).
- A request ends at its sample's natural length (last token EOS, finish "stop" with "matched", also when that
  EOS falls on the last allowed position, as SGLang 0.5.23 reports it) or at max_new_tokens ("length").
- on_result returning True (or calling abort_all()) at virtual time T: every running request answers with
  the tokens of the steps its engine completed by T (finish "abort"; a request whose last step ended exactly
  at T has finished normally), queued requests answer with none, and the clock stops at T.

- detach=True (rollout.overlap): on_result returning True at T returns at once (no on_result: at the call, after the
  first fill); running and queued requests stay and decode on through advance() (the learner's update) as in a
  generate call. update_weights with requests running pauses the engines for pause_s in `pause_mode`: abort (they
  answer at the pause with their tokens so far, finish "abort"), in_place (they go on with their KV after the swap),
  retract (they go on after their KV is recomputed: a prefill of prompt + output). Tokens after the swap carry the new version: an answer that lived through an update
  reports SGLang's meta_info.weight_versions spans. A step in progress at the pause is lost (it restarts after it).
  collect_detached() at T aborts what still runs (as above) and returns the detached call's answers.

The loop is event-driven: between two events an engine's batch is fixed, so it jumps straight to the
next time a request ends on any engine. Costs are per request, never per token or per step.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ...rollout.sglang.protocol import GenerateJob, GenerateResponse
from .workload import DEFAULT_EOS, answer, parse_simulated_input, response_tokens

NS = 1_000_000_000
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class EngineTiming:
    """Defaults: about a 7B model on one H100-class GPU per engine, 8 engines."""

    num_engines: int = 8
    slots_per_engine: int = 256
    step_base_s: float = 0.015
    step_per_seq_s: float = 0.00008
    prefill_per_token_s: float = 0.00002  # 50k prompt tokens/s

    def __post_init__(self):
        for name in ("num_engines", "slots_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineTiming.{name} must be >= 1; got {getattr(self, name)}")
        if self.step_base_s <= 0 or self.step_per_seq_s < 0 or self.prefill_per_token_s < 0:
            raise ValueError("EngineTiming: step_base_s must be > 0, step_per_seq_s and prefill_per_token_s >= 0")


class _Request:
    """One request; `produce` (tokens it will generate) and `eos` are fixed when it is admitted."""

    __slots__ = ("index", "rid", "input_len", "group", "j", "start", "budget", "produce", "eos", "start_step",
                 "return_logprob", "received_ns", "engine", "spans", "cutoff_group")

    def __init__(self, index, rid, input_len, group, j, start, budget, return_logprob, received_ns, engine=None):
        self.index, self.rid, self.input_len, self.group, self.j = index, rid, input_len, group, j
        self.engine = engine
        self.start, self.budget, self.return_logprob, self.received_ns = start, budget, return_logprob, received_ns
        self.produce, self.eos, self.start_step = 0, False, 0
        self.spans: list[tuple[int, int]] = []  # (weight version, first output position it made), from admission
        self.cutoff_group = None


class _Engine:
    """One engine: `steps` completed by time `t`; the batch (a heap by finish step) is fixed since t. Busy time is
    counted up to `counted` (a pause for a weight swap is not busy)."""

    def __init__(self):
        self.t = self.steps = self.pending_prefill = self.counted = 0
        self.heap: list[tuple[int, int, _Request]] = []
        self.busy_ns = self.slot_ns = 0

    def step_ns(self, base: int, per_seq: int) -> int:
        return base + per_seq * len(self.heap)

    def next_event(self, base: int, per_seq: int) -> int:
        return self.t + self.pending_prefill + (self.heap[0][0] - self.steps) * self.step_ns(base, per_seq)

    def steps_by(self, now: int, base: int, per_seq: int) -> int:
        """Steps completed by time `now` (>= t) with the current batch."""
        step = self.step_ns(base, per_seq)
        first_end = self.t + self.pending_prefill + step
        return self.steps + (0 if now < first_end else 1 + (now - first_end) // step)

    def account(self, now: int) -> None:
        """Busy time up to `now`, which becomes the engine's time base (its batch changes there)."""
        self.count(now)
        self.t = now

    def count(self, now: int) -> None:
        if self.heap and now > self.counted:
            self.busy_ns += now - self.counted
            self.slot_ns += len(self.heap) * (now - self.counted)
        self.counted = max(self.counted, now)

    def pause(self, now: int, pause_ns: int, base: int, per_seq: int) -> None:
        """Generation stops at `now` for pause_ns: the steps completed by then stand, a step in progress restarts."""
        steps = self.steps_by(now, base, per_seq)
        self.count(now)
        if steps > self.steps:
            self.steps, self.pending_prefill = steps, 0
        self.t = self.counted = now + pause_ns


class SimulatedEngine:
    """Same generation interface as spillover.rollout.fleet.manager.RolloutManager; not thread-safe (one caller)."""

    def __init__(self, timing: EngineTiming, lengths, eos_token_id: int = DEFAULT_EOS, weight_version: int = 0,
                 pause_mode: str = "in_place"):
        """lengths: anything with group_lengths(group_id) -> int[n] natural response lengths
        (bench.simulator.workload.LognormalLengths, TableLengths); pause_mode: what a weight update does to
        detached requests (abort, retract, in_place)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"SimulatedEngine: pause_mode must be one of {PAUSE_MODES}; got {pause_mode!r}")
        self.pause_mode = pause_mode
        self.timing, self.lengths, self.eos, self.weight_version = timing, lengths, int(eos_token_id), weight_version
        # requests pinned to no engine wait in one queue and each goes to the first engine with a free slot: a
        # load-aware pool, so length-aware dispatch only orders them: it pins to num_engines engines
        # (DispatchPlanner.from_config), one here; bench/longtail.py's *_pinned modes set
        # timing.num_engines
        self.num_engines = 1
        self._base, self._per_seq = round(timing.step_base_s * NS), round(timing.step_per_seq_s * NS)
        self._prefill = round(timing.prefill_per_token_s * NS)
        self._now = 0
        self._engines = [_Engine() for _ in range(timing.num_engines)]
        self._natural: dict[int, list[int]] = {}
        self._free_j: dict[int, list[int]] = {}
        self._abort_requested = False
        self._running = False
        self._results: list = []
        self._detached: tuple | None = None  # (queue_of, queued requests, indices unanswered when it detached)
        self._adopted: tuple | None = None   # the same, of requests collect_detached(adopt=True) left for the next call
        self._started_groups: set[int] = set()  # cutoff groups with a request admitted in the current call
        self.tokens_generated = self.prefill_tokens = self.requests_done = 0
        self.recomputed_prefill_tokens = 0  # retract: the KV of paused requests computed again
        self.continued_prefill_tokens = 0   # prefill of requests that continue a partial response
        self.detached_tokens = 0            # generated after their call returned (overlap)
        self.pauses = 0

    # ---- clock, weights, counters -------------------------------------------------------------------
    @property
    def clock_s(self) -> float:
        return self._now / NS

    def advance(self, seconds: float) -> None:
        """Let virtual time pass (e.g. the learner's update): detached requests decode on, the other engines idle."""
        if seconds < 0:
            raise ValueError(f"advance: seconds must be >= 0; got {seconds}")
        target = self._now + round(seconds * NS)
        if self._detached is not None:
            self._loop(self._detached[0], until=target)
        self._now = target
        for engine in self._engines:
            engine.count(target)
            if not engine.heap:
                engine.t = target

    def update_weights(self, weights, weight_version: int, pause_s: float = 0.0) -> dict[int, int]:
        """The engines report `weight_version` from now on (weights themselves are not simulated). Detached requests
        running: the engines pause for pause_s (the swap) in pause_mode."""
        if pause_s < 0:
            raise ValueError(f"update_weights: pause_s must be >= 0; got {pause_s}")
        pause_ns = round(pause_s * NS)
        if self._detached is not None and any(e.heap for e in self._engines):
            self.pauses += 1
            if self.pause_mode == "abort":
                self._abort_everything(self._detached[1])
            else:
                for engine in (e for e in self._engines if e.heap):
                    running = [item[2] for item in engine.heap]
                    engine.pause(self._now, pause_ns, self._base, self._per_seq)
                    for req in running:
                        req.spans.append((weight_version, engine.steps - req.start_step))
                        # a request with no step since its admission still has its prefill ahead (it restarts)
                        if self.pause_mode == "retract" and req.start_step < engine.steps:
                            recompute = req.input_len + engine.steps - req.start_step
                            engine.pending_prefill += self._prefill * recompute
                            self.recomputed_prefill_tokens += recompute
                            self.prefill_tokens += recompute
        self._now += pause_ns
        for engine in self._engines:
            if not engine.heap:
                engine.t = engine.counted = max(engine.t, self._now)
        self.weight_version = weight_version
        return {i: weight_version for i in range(self.timing.num_engines)}

    def usage(self) -> dict:
        """Cumulative counters: diff two readings to measure a stretch of virtual time."""
        return {"clock_s": self.clock_s, "engine_busy_s": sum(e.busy_ns for e in self._engines) / NS,
                "slot_busy_s": sum(e.slot_ns for e in self._engines) / NS, "tokens_generated": self.tokens_generated,
                "prefill_tokens": self.prefill_tokens, "requests": self.requests_done,
                "recomputed_prefill_tokens": self.recomputed_prefill_tokens,
                "continued_prefill_tokens": self.continued_prefill_tokens, "detached_tokens": self.detached_tokens,
                "pauses": self.pauses}

    def abort_all(self) -> None:
        """Stop the running generate() at the current virtual time (a no-op when nothing runs)."""
        if self._running:
            self._abort_requested = True

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, jobs: list[GenerateJob], on_result: Callable[[int, GenerateResponse], None] | None = None,
                 detach: bool = False) -> list[GenerateResponse | None]:
        """The /generate answers of `jobs` (input_ids, sampling_params.max_new_tokens, rid, return_logprob; a pinned
        engine), in input order; on_result(index, answer) as each one ends, in virtual-time order.
        detach: on_result returning True returns at once, the unanswered requests (None here) run on."""
        if self._running:
            raise RuntimeError("SimulatedEngine.generate is not re-entrant (call abort_all() from a callback)")
        if self._detached is not None:
            raise RuntimeError("SimulatedEngine.generate: a detached call still runs; collect_detached() first")
        self._running, self._abort_requested = True, False
        adopted, self._adopted = self._adopted, None
        self._results = [None] * (len(jobs) + (len(adopted[2]) if adopted else 0))
        self._started_groups = set()
        self._on_result = on_result
        left_running = False
        try:
            queue = deque(self._parse(i, job) for i, job in enumerate(jobs))
            for req in [r for r in queue if r.budget == 0]:  # nothing to generate: answered at once
                self._deliver(req, 0, "length")
            queue = deque(r for r in queue if r.budget > 0)
            left_running = self._run(queue, detach, self._adopt(adopted, len(jobs)) if adopted else None)
        finally:
            self._running, self._on_result = False, None
            if not left_running:
                for engine in self._engines:  # after an error in a callback: drop what was running
                    engine.account(self._now)
                    engine.heap.clear()
                    engine.pending_prefill = 0
        return list(self._results)

    def collect_detached(self, adopt: bool = False) -> dict[int, GenerateResponse]:
        """The answers of every request the last detached call left unanswered (index -> answer); what still runs
        is aborted now with its tokens so far. {} when nothing is detached. adopt: only the answers of the requests
        that have ended; the others run on, and the next generate takes them over as requests len(jobs) + k (k
        their order by index here)."""
        if self._detached is None and self._adopted is not None:  # adopted, then collected before any generate
            self._detached, self._adopted = self._adopted, None
        if self._detached is None:
            return {}
        if adopt:
            queue_of, queue, pending = self._detached
            self._detached = None
            running = [i for i in pending if self._results[i] is None]
            if running:
                self._adopted = (queue_of, queue, running)
            return {i: self._results[i] for i in pending if self._results[i] is not None}
        _, queue, pending = self._detached
        if any(e.heap for e in self._engines) or queue:
            self._abort_everything(queue)
        self._detached = None
        for engine in self._engines:
            engine.account(self._now)
        return {i: self._results[i] for i in pending}

    def _parse(self, index: int, job: GenerateJob) -> _Request:
        request = job.request
        ids = request.input_ids
        group, plen, j = parse_simulated_input(ids)
        req = _Request(index, request.rid or f"sim-{index}", len(ids), group, j, len(ids) - plen,
                       int(request.sampling_params.max_new_tokens), request.return_logprob, self._now, job.engine)
        req.cutoff_group = job.cutoff_group
        return req

    def _adopt(self, adopted: tuple, base: int) -> tuple:
        """The adopted requests (running or queued) become requests base + k of this call, in their old index order;
        -> (queue_of, queued) of the round they came from, which this call's requests join."""
        queue_of, queued, running = adopted
        remap = {old: base + k for k, old in enumerate(running)}
        for req in queued:
            req.index = remap[req.index]
        for engine in self._engines:
            for _, _, req in engine.heap:
                req.index = remap[req.index]
            engine.heap = [(end, req.index, req) for end, _, req in engine.heap]
            heapq.heapify(engine.heap)
            if engine.heap:  # its batch changes now: a pause of no length (a step in progress restarts)
                engine.pause(self._now, 0, self._base, self._per_seq)
        return queue_of, queued

    def _run(self, queue: deque, detach: bool, adopted: tuple | None = None) -> bool:
        """-> True when the call detached with requests left running. detach without on_result: it detaches at once,
        after the first fill (a request of a start-cutoff group never starts: the batch choice is now). adopted:
        (queue_of, queued) of the adopted requests' round; this call's requests queue behind its queued ones."""
        engines, size = self._engines, self.timing.slots_per_engine
        at_once = detach and self._on_result is None
        if adopted is not None:
            queue_of, queued = adopted
        elif any(r.engine is not None for r in queue):  # pinned jobs (RolloutManager's per-engine dispatch)
            queues = _Queues([deque() for _ in engines])
            index = {id(e): i for i, e in enumerate(engines)}
            queue_of, queued = (lambda engine: queues.queues[index[id(engine)]]), queues
        else:
            shared = deque()
            queue_of, queued = (lambda engine: shared), shared
        queued.extend(queue)
        if at_once:
            self._hold_until_detach(queued)
        if isinstance(queued, _Queues):
            for engine, own in zip(engines, queued.queues):
                while own and len(engine.heap) < size:
                    self._admit(engine, own.popleft())
        else:  # first fill: round robin over the engines with a free slot
            while queued and any(len(e.heap) < size for e in engines):
                for engine in engines:
                    if queued and len(engine.heap) < size:
                        self._admit(engine, queued.popleft())
        if not at_once and not self._loop(queue_of):
            return False
        if detach and (queued or any(e.heap for e in engines)):
            self._detached = (queue_of, queued, [i for i, r in enumerate(self._results) if r is None])
            self._abort_requested = False
            self._hold_until_detach(queued)
            return True
        self._abort_everything(queued)
        return False

    def _loop(self, queue_of, until: int | None = None) -> bool:
        """Run events until every engine is idle or the next event lies past `until` (-> False), or a stop is
        requested (-> True)."""
        engines, size = self._engines, self.timing.slots_per_engine
        while not self._abort_requested:
            busy = [e for e in engines if e.heap]
            if not busy:
                return False
            engine = min(busy, key=lambda e: e.next_event(self._base, self._per_seq))  # ties: lowest index
            now = engine.next_event(self._base, self._per_seq)
            if until is not None and now > until:
                return False
            engine.account(now)
            self._now = now
            engine.steps, engine.pending_prefill = engine.heap[0][0], 0
            while engine.heap and engine.heap[0][0] == engine.steps:
                req = heapq.heappop(engine.heap)[2]
                self._deliver(req, req.produce, self._finish_type(req))
            if self._abort_requested:
                break
            queue = queue_of(engine)
            while queue and len(engine.heap) < size:
                self._admit(engine, queue.popleft())
        return True

    def _hold_until_detach(self, queued) -> None:
        """Queued requests with a cutoff_group (rollout.start_cutoff) none of whose requests started in this call leave
        the queue unstarted: collect_detached answers them with no tokens, as RolloutManager answers a request it
        never sent."""
        def waits(req: _Request) -> bool:
            return req.cutoff_group is not None and req.cutoff_group not in self._started_groups

        for own in (queued.queues if isinstance(queued, _Queues) else [queued]):
            held = [req for req in own if waits(req)]
            if held:
                kept = [req for req in own if not waits(req)]
                own.clear()
                own.extend(kept)
            for req in held:
                ids, entries = response_tokens(req.start, 0, 0, False, self.eos)
                self._results[req.index] = answer(req.rid, req.input_len, ids, entries if req.return_logprob else None,
                                                  "abort", self.eos, self.weight_version, 0.0, None)

    def claim_samples(self, held: dict[int, list[int]]) -> None:
        """A run resumed from a checkpoint on new engines: held[group] are the sample indices its rows in the dock
        hold already (a row's first response token is its sample key), so fresh rows of the group get the others."""
        for group, taken in held.items():
            natural = self._natural_of(group)
            self._free_j[group] = [j for j in range(len(natural)) if j not in set(taken)]

    def _natural_of(self, group: int) -> list[int]:
        natural = self._natural.get(group)
        if natural is None:
            natural = self._natural[group] = [int(x) for x in self.lengths.group_lengths(group)]
            self._free_j[group] = list(range(len(natural)))
        return natural

    def _admit(self, engine: _Engine, req: _Request) -> None:
        natural = self._natural_of(req.group)
        if req.j is None:
            free = self._free_j[req.group]
            if not free:
                raise RuntimeError(f"simulated engine: group {req.group} got more than {len(natural)} fresh "
                                   "requests (each of its n rows starts once; continue partial rows from their ids)")
            req.j = heapq.heappop(free)
        remaining = natural[req.j] - req.start
        if remaining < 1:
            raise ValueError(f"simulated engine: group {req.group} sample {req.j} already has {req.start} tokens, "
                             f"its natural length is {natural[req.j]}")
        req.eos = remaining <= req.budget
        req.produce = min(remaining, req.budget)
        req.start_step = engine.steps
        req.spans = [(self.weight_version, 0)]
        if req.cutoff_group is not None:
            self._started_groups.add(req.cutoff_group)
        heapq.heappush(engine.heap, (engine.steps + req.produce, req.index, req))
        engine.pending_prefill += self._prefill * req.input_len
        self.prefill_tokens += req.input_len
        if req.start:
            self.continued_prefill_tokens += req.input_len

    @staticmethod
    def _finish_type(req: _Request) -> str:
        """SGLang 0.5.23: an EOS ends a request with "stop", also on the last allowed position."""
        return "stop" if req.eos else "length"

    def _abort_everything(self, queue: deque) -> None:
        """At the current time: running requests answer with what their engine's completed steps gave them."""
        cut: list[tuple[_Request, int]] = []
        for engine in self._engines:
            steps = engine.steps_by(self._now, self._base, self._per_seq)
            engine.account(self._now)
            engine.steps, engine.pending_prefill = steps, 0
            cut += [(req, min(steps - req.start_step, req.produce)) for _, _, req in engine.heap]
            engine.heap.clear()
        cut += [(req, 0) for req in queue]
        queue.clear()
        for engine in self._engines:
            engine.t = self._now
        for req, produced in sorted(cut, key=lambda item: item[0].index):
            if req.j is not None and produced == 0 and req.start == 0:
                heapq.heappush(self._free_j[req.group], req.j)  # no token carries its key: hand j out again
                req.j = None
            if produced > 0 and produced == req.produce:
                self._deliver(req, produced, self._finish_type(req))
            else:
                self._deliver(req, produced, "abort")

    def _deliver(self, req: _Request, produced: int, finish: str) -> None:
        ends_with_eos = finish != "abort" and req.eos and produced == req.produce
        ids, entries = response_tokens(req.start, produced, req.j if req.j is not None else 0, ends_with_eos,
                                       self.eos)
        spans = [(v, start, end) for (v, start), end in zip(req.spans, [s for _, s in req.spans[1:]] + [produced])
                 if end > start] if len(req.spans) > 1 else None
        response = answer(req.rid, req.input_len, ids, entries if req.return_logprob else None, finish, self.eos,
                          self.weight_version, (self._now - req.received_ns) / NS, spans)
        self.tokens_generated += produced
        if not self._running:
            self.detached_tokens += produced
        self.requests_done += 1
        self._results[req.index] = response
        if self._on_result is not None and self._on_result(req.index, response) is True:
            self._abort_requested = True


class _Queues:
    """The per-engine queues of a detached call as one: empty when all are, clear() empties all, iteration yields
    their requests (what _abort_everything needs)."""

    def __init__(self, queues: list[deque]):
        self.queues = queues

    def __bool__(self) -> bool:
        return any(self.queues)

    def __iter__(self):
        return (req for own in self.queues for req in own)

    def extend(self, requests) -> None:
        """Each request joins its engine's queue (FIFO per engine); one pinned to none goes round robin."""
        for k, req in enumerate(requests):
            self.queues[(req.engine if req.engine is not None else k) % len(self.queues)].append(req)

    def clear(self) -> None:
        for own in self.queues:
            own.clear()
