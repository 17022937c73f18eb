"""Batches through the router, and abort_all across the engines (the router has no abort).

A batch is one *round*. abort_all marks every round stopped on the client side first (nothing new is
sent; unsent requests come back as aborted with no tokens), then aborts each engine directly and keeps
doing so until every engine's /v1/loads is idle and no request of a stopped round is still on the wire.
Running requests come back with their tokens so far and finish_reason abort. A caller stops a round from
inside it by returning True from on_result: the round then runs abort_all itself and returns once the
engines are idle, so no abort outlives the call that asked for it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .engine_client import EngineClient, EngineError, EngineUnreachable
from .pinned_router import PinnedRouter
from ..sglang.protocol import GenerateJob, GenerateResponse, new_rid
from ..contracts.fleet import OnResult

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Round:
    """One generate call: `stopped` by abort_all; `in_flight` counts its requests still on the wire."""

    stopped: bool = False
    in_flight: int = 0


@dataclass(eq=False)
class Relay:
    """Where a detached round's later answers and failures go: nowhere (kept for collect_detached) until a call adopts
    its requests, then to that call (`to(index, answer)`, `fail(index, error)`, the index in the detached round)."""

    to: Callable[[int, GenerateResponse], None] | None = None
    fail: Callable[[int, BaseException], None] | None = None


@dataclass(eq=False)
class DetachedRound:
    """A round whose caller returned while requests still ran (rollout.overlap): `runs` finishes once they have all
    answered; `pending` are the indices the caller got no answer for. `cut_by_pause`: the indices unanswered when an
    abort-mode pause (a weight update) ended every request on the engines; `cut_tokens`: the output tokens those
    requests came back with, counted when the round is collected. `generating_s` of `span_s` (set when collected):
    how long requests still ran between the detach and the collection. `failures`: index -> the error of each request
    that failed (it never answers, so it must not pass for one still running)."""

    round: Round
    runs: asyncio.Future
    results: list[GenerateResponse | None]
    pending: list[int]
    limit: asyncio.Semaphore                  # the in-flight limit its unsent requests wait for
    relay: Relay = field(default_factory=Relay)
    failures: dict[int, BaseException] = field(default_factory=dict)
    adopted_rounds: list[Round] = field(default_factory=list)  # older rounds whose requests it adopted
    cut_by_pause: set[int] = field(default_factory=set)
    cut_tokens: int = 0
    detached_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    generating_s: float = 0.0
    span_s: float = 0.0

    def __post_init__(self) -> None:
        self.runs.add_done_callback(lambda _: setattr(self, "finished_at", self.finished_at or time.monotonic()))

    @property
    def rounds(self) -> list[Round]:
        """Its own round and those it adopted requests from: all done once its runs are."""
        return [self.round, *self.adopted_rounds]

    def note_collected(self) -> None:
        now = time.monotonic()
        self.span_s = now - self.detached_at
        self.generating_s = (self.finished_at or now) - self.detached_at

    def note_abort_pause(self) -> None:
        self.cut_by_pause |= {i for i in self.pending if self.results[i] is None}

    def tokens_cut_by_pause(self) -> int:
        """Output tokens of the requests an abort-mode pause ended (answered with finish_reason abort by now; one
        still unsent at the pause was sent after it and is not counted)."""
        cut = (self.results[i] for i in self.cut_by_pause if self.results[i] is not None)
        return sum(len(a.output_ids) for a in cut if a.meta_info.finish_reason.type == "abort")


class BatchGenerator:
    """Runs on the manager's loop. `recover()` is awaited after a failed attempt (a shared health check)."""

    def __init__(self, router: PinnedRouter, engine_urls: Callable[[], list[str]],
                 client_for: Callable[[str], EngineClient], recover: Callable[[], Awaitable[None]],
                 max_attempts: int = 5, max_in_flight: int = 256):
        self.router, self.engine_urls, self.client_for, self.recover = router, engine_urls, client_for, recover
        self.max_attempts, self.max_in_flight = max_attempts, max_in_flight
        self.rounds: set[Round] = set()
        self.detached: DetachedRound | None = None
        self.adopted: tuple[DetachedRound, list[int]] | None = None  # (its round, the indices the next call takes)

    async def generate_round(self, batch: list[GenerateJob], on_result: OnResult | None = None,
                             detach: bool = False) -> list[GenerateResponse | None]:
        """Answers in input order; on_result(index, answer) as each finishes. An on_result that returns True
        stops every running round and aborts every engine (abort_all); the call returns once they are idle.
        With detach, it returns at once instead: the requests not answered yet run on (None in the answers) and
        collect_detached hands their answers over; on_result is not called again after that True. detach without
        on_result returns at the call (nothing waits for an answer), every request running on.
        Requests adopted by collect_detached(adopt=True) join this call as indices len(batch) + k.
        A bad item raises after the others have finished (so no request is left running on an engine)."""
        if detach and self.detached is not None:  # (a plain round may run beside it: an eval's)
            raise RuntimeError("a detached round still waits: collect_detached() before the next detached generate")
        adopted, self.adopted = self.adopted, None
        round_ = Round()
        self.rounds.add(round_)
        older = adopted[0].rounds if adopted else []
        limit = adopted[0].limit if adopted else asyncio.Semaphore(self.max_in_flight)
        taken = adopted[1] if adopted else []
        results: list[GenerateResponse | None] = [None] * (len(batch) + len(taken))
        reported = [False] * len(results)
        abort: asyncio.Future | None = None
        detached = asyncio.Event()
        if detach and on_result is None:
            detached.set()
        relay = Relay()
        failures: dict[int, BaseException] = {}
        started_groups: set[int] = set()

        def fail(index: int, error: BaseException) -> None:
            failures[index] = error
            if relay.fail is not None:
                relay.fail(index, error)

        def deliver(index: int, answer: GenerateResponse) -> None:
            nonlocal abort
            results[index] = answer
            if detached.is_set():  # the caller has gone on: collect_detached (or an adopting call) hands it over
                if relay.to is not None:
                    relay.to(index, answer)
                return
            reported[index] = True
            if on_result is not None and on_result(index, answer) is True:
                if detach:
                    detached.set()
                elif abort is None:
                    self.stop_rounds()  # at once: nothing more is sent while the abort starts
                    abort = asyncio.ensure_future(self.abort_all())

        async def run(index: int, job: GenerateJob) -> None:
            async with limit:
                if job.cutoff_group is not None:  # rollout.start_cutoff: a group not started by then waits a step
                    if detached.is_set() and job.cutoff_group not in started_groups:
                        deliver(index, GenerateResponse.never_sent(job.request, "its group did not start before "
                                                                   "the batch choice (rollout.start_cutoff)"))
                        return
                    started_groups.add(job.cutoff_group)
                try:
                    answer = await self.generate_one(job, round_)
                except BaseException as error:
                    fail(index, error)
                    raise
            deliver(index, answer)

        own = asyncio.ensure_future(asyncio.gather(*(run(i, job) for i, job in enumerate(batch)),
                                                   return_exceptions=True))
        runs = own
        if adopted:
            previous = adopted[0]
            position = {old: len(batch) + k for k, old in enumerate(taken)}
            for old in taken:  # answers (and failures) that came between the collection and this call
                if previous.results[old] is not None:
                    deliver(position[old], previous.results[old])
                elif old in previous.failures:
                    fail(position[old], previous.failures[old])
            previous.relay.to = lambda old, answer: deliver(position[old], answer) if old in position else None
            previous.relay.fail = lambda old, error: fail(position[old], error) if old in position else None
            runs = asyncio.ensure_future(_joined(own, previous.runs))
        if detach:
            stopped = asyncio.ensure_future(detached.wait())
            await asyncio.wait({runs, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            # also when every request has ended by now: the ones that ended after the stop were not reported, and
            # only collect_detached hands them over
            if not runs.done() or not all(reported):
                self.detached = DetachedRound(round_, runs, results, [i for i, r in enumerate(reported) if not r],
                                              limit, relay, failures, older)
                return [r if done else None for r, done in zip(results, reported)]
        try:
            outcomes = list(await runs)
            if abort is not None:
                outcomes += await asyncio.gather(abort, return_exceptions=True)
        finally:
            self.rounds.difference_update([round_, *older])
            if abort is not None and not abort.done():  # cancelled: do not leave the abort running
                abort.cancel()
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        return results

    async def collect_detached(self, adopt: bool = False) -> dict[int, GenerateResponse]:
        """The detached round's unanswered requests: what still runs is aborted (its tokens so far come back), then
        index -> answer for each; {} when no round is detached. adopt: only the requests that have answered; the
        others run on and the next generate_round takes them over (index len(batch) + k, k their order here), unless
        one of them failed: then nothing is adopted, the rest is aborted and the error raised, as without adopt."""
        if self.detached is None and self.adopted is not None:  # adopted, then collected before any generate
            previous, running = self.adopted
            previous.pending, self.detached, self.adopted = running, previous, None  # the others were handed over
        detached, self.detached = self.detached, None
        if detached is None:
            return {}
        detached.cut_tokens = detached.tokens_cut_by_pause()  # before our own abort ends the others the same way
        detached.note_collected()  # before the abort: what it ends is not generation the overlap bought
        if adopt and not any(i in detached.failures for i in detached.pending):
            running = [i for i in detached.pending if detached.results[i] is None]
            if running:
                self.adopted = (detached, running)
            else:
                self.rounds.difference_update(detached.rounds)
            return {i: detached.results[i] for i in detached.pending if detached.results[i] is not None}
        try:
            if not detached.runs.done():
                await self.abort_all()
            outcomes = await detached.runs
        finally:
            self.rounds.difference_update(detached.rounds)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        return {i: detached.results[i] for i in detached.pending}

    async def generate_one(self, job: GenerateJob, round_: Round) -> GenerateResponse:
        """The job's answer: sent to its pinned engine (looked up at each attempt: a restarted engine has a new URL)
        or through the router; a transport failure or a 5xx is retried after recover(), under a new request id: SGLang
        refuses an id it still holds ("Duplicate request ID", a 400), and the first try may still run there."""
        request = job.request
        failure: Exception | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                request = request.model_copy(update={"rid": new_rid()})
            if round_.stopped:
                return GenerateResponse.never_sent(request, "aborted before it was sent (abort_all)")
            round_.in_flight += 1
            try:
                return await self.router.client(job.engine).generate(request)
            except EngineError as err:
                if err.status < 500:
                    raise ValueError(f"request {request.rid} was refused: {err.message}") from None
                failure = err
            except EngineUnreachable as err:
                failure = err
            finally:
                round_.in_flight -= 1
            log.warning("request %s failed (attempt %d/%d): %r", request.rid, attempt + 1, self.max_attempts, failure)
            if not round_.stopped:
                await self.recover()
        raise RuntimeError(f"request {request.rid} failed {self.max_attempts} times; last error: {failure!r}")

    def stop_rounds(self) -> None:
        """Client side of abort_all: no running round sends anything more. Safe from any thread."""
        for round_ in list(self.rounds):
            round_.stopped = True

    async def abort_all(self, timeout_s: float = 60.0) -> None:
        self.stop_rounds()
        deadline = time.monotonic() + timeout_s
        busy = self.engine_urls()
        while busy:
            await asyncio.gather(*(self._abort(url) for url in busy))
            await asyncio.sleep(0.05)
            idle = await asyncio.gather(*(self._idle(url) for url in busy))
            on_wire = sum(r.in_flight for r in self.rounds if r.stopped)
            busy = [url for url, ok in zip(busy, idle) if not ok] or (self.engine_urls() if on_wire else [])
            if busy and time.monotonic() > deadline:
                raise TimeoutError(f"engines {busy} still busy {timeout_s} s after abort_all "
                                   f"({on_wire} requests on the wire)")

    async def _abort(self, url: str) -> None:
        try:
            await self.client_for(url).abort(abort_all=True)
        except (EngineUnreachable, EngineError) as err:  # a dead engine has nothing to abort
            log.warning("abort on %s failed: %r", url, err)

    async def _idle(self, url: str) -> bool:
        try:
            return (await self.client_for(url).loads()).idle
        except (EngineUnreachable, EngineError):
            return True


async def _joined(*futures: asyncio.Future) -> list:
    """The outcome lists of several gathers (return_exceptions=True), one after the other, as one list."""
    out: list = []
    for future in futures:
        out += list(await future)
    return out
