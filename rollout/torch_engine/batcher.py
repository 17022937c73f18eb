"""Continuous batching over a fixed-slot KV cache, run by one engine thread.

Each running request owns a cache slot (the lowest free one, so active slots stay packed at the front).
Every step: handle commands (new requests, aborts, control calls), prefill waiting requests into free
slots in one padded batch (admission waits a few steps to batch prefills), then one decode step for
all running requests (slot_runner.py). Finished requests free their slot at once, so new ones join
without waiting for the batch.

Callers talk to the thread through `submit`, `abort` and `call` (all thread-safe); results come back as
`concurrent.futures.Future`s holding the /generate answer (protocol.GenerateResponse).
"""
from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Callable

from .lean_forward import LeanDecoder
from ..sglang.protocol import GenerateResponse, MetaInfo, SamplingParams
from .slot_runner import SlotRunner

log = logging.getLogger(__name__)
# An idle loop wakes only to see a stop; work wakes it at once. At 20 Hz the ticks cost an idle engine ~2.5 ms of
# CPU per second (measured), as much as everything else it does idle.
IDLE_TICK_S = 0.25
ADMIT_BATCH_DIVISOR = 8
ADMIT_MAX_WAIT_STEPS = 8


@dataclass
class EngineRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    max_output: int  # max_new_tokens capped by the context length
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()  # sampling_params.stop
    stop_tail_tokens: int = 0  # output tokens decoded to look for a stop string (SGLang: longest stop + 1)
    decode: Callable[[list[int]], str] | None = None
    future: Future = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    # SGLang's weight-version events: (the version before a change, output tokens it had made by then), one per
    # change the request lived through with output; its answer's meta_info.weight_versions spans come from them
    version_events: list[tuple[int | str, int]] = field(default_factory=list)

    @property
    def tokens_so_far(self) -> list[int]:
        """What a prefill of this request feeds: the prompt, and the output of a request retracted mid-way."""
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids


class ContinuousBatcher:
    """The engine loop: owns requests and slot assignment; `runner` owns the tensors (cache, slot state)."""

    def __init__(self, decoder: LeanDecoder, max_running_requests: int, max_len: int, seed: int = 0,
                 weight_version: int | str = 0, prefill_token_budget: int = 8192):
        self.decoder = decoder
        self.runner = SlotRunner(decoder, max_running_requests, max_len, seed)
        self.num_slots, self.max_len = max_running_requests, max_len
        self.prefill_token_budget = prefill_token_budget
        self.weight_version = weight_version
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.waiting: list[EngineRequest] = []
        self.running: dict[int, EngineRequest] = {}
        self._free: list[int] = list(range(self.num_slots))
        self._pending_drain: list[tuple[Callable[[], Any], Future]] = []  # run once no request runs
        self.paused = False
        self.steps = 0  # decode steps so far
        self._waiting_since = 0  # the step at which the waiting queue last became non-empty
        self.heartbeat = time.monotonic()
        self.generated_tokens = 0

    # ---- thread-safe API -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: EngineRequest) -> Future:
        self._inbox.put(("submit", request))
        self._wake.set()
        return request.future

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._inbox.put(("abort", rid, abort_all))
        self._wake.set()

    def call(self, fn: Callable[[], Any], when_idle: bool = False) -> Future:
        """Run fn on the engine thread between steps; with when_idle, once no request is running
        (admission stops meanwhile, so the running ones drain)."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut, when_idle))
        self._wake.set()
        return fut

    def set_weight_version(self, version: int | str | None) -> None:
        """Engine thread only, between steps: the version of every token generated from now on. As SGLang's
        record_weight_version_change: a change (None or the same version is none) gives every running or waiting
        request with output an event (old version, its output tokens so far). Every token so far was sampled
        from the old weights (no step is in flight between two steps, paused in_place or not), so the spans label
        each token with the weights that made it."""
        if version is None or str(version) == str(self.weight_version):
            return
        old, self.weight_version = self.weight_version, version
        for req in [*self.running.values(), *self.waiting]:
            if req.output_ids:
                req.version_events.append((old, len(req.output_ids)))

    def pause(self, mode: str) -> None:
        """Engine thread only: SGLang's /pause_generation. abort: every request returns now with its partial
        output (finish_reason abort); retract: running requests go back to the front of the queue and free their
        KV cache (recomputed from prompt + output on continue); in_place: running requests keep their slots and KV.
        In every mode no step runs until resume()."""
        if mode == "abort":
            self._abort("", abort_all=True)
        elif mode == "retract":
            retracted = [self.running[s] for s in sorted(self.running)]
            for req in retracted:
                self._release(req)
            self.waiting = retracted + self.waiting
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def reseed(self, seed: int) -> Future:
        """Restart the sampling generator from seed, on the engine thread once no request runs."""
        return self.call(lambda: self.runner.reseed(seed), when_idle=not self.paused)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests; waiting includes submissions not yet seen by the loop."""
        return len(self.running), len(self.waiting) + self._inbox.qsize()

    # ---- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._drain_inbox()
            if self._pending_drain and not self.running:
                self._run_drain_calls()
            can_step = not self.paused and self.runner.cache is not None
            admitting = can_step and not self._pending_drain and self._should_admit()
            if not admitting and not (can_step and self.running):
                self._wake.wait(IDLE_TICK_S)
                continue
            try:
                if admitting:
                    self._prefill()
                if self.running:
                    self._decode()
                # the health probe's sign of life, as SGLang's last output received: none while paused or idle
                self.heartbeat = time.monotonic()
            except Exception as err:  # a failed step fails its requests, not the engine
                log.exception("engine step failed")
                for req in list(self.running.values()):
                    self._release(req)
                    if not req.future.done():  # a health probe's may have been cancelled by its time limit
                        req.future.set_exception(err)
        for req in list(self.running.values()) + self.waiting:
            self._finish(req, {"type": "abort", "message": "engine stopped", "status_code": 503, "err_type": None})

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "submit":
                if not self.waiting:
                    self._waiting_since = self.steps
                self.waiting.append(item[1])
            elif kind == "abort":
                self._abort(item[1], item[2])
            elif kind == "call":
                _, fn, fut, when_idle = item
                if when_idle:
                    self._pending_drain.append((fn, fut))
                else:
                    self._run_call(fn, fut)

    @staticmethod
    def _run_call(fn: Callable[[], Any], fut: Future) -> None:
        try:
            fut.set_result(fn())
        except Exception as err:
            fut.set_exception(err)

    def _run_drain_calls(self) -> None:
        calls, self._pending_drain = self._pending_drain, []
        for fn, fut in calls:
            self._run_call(fn, fut)

    def _abort(self, rid: str, abort_all: bool) -> None:
        hit = (lambda r: True) if abort_all else (lambda r: r.rid.startswith(rid))
        if not abort_all and not rid:
            return
        reason = {"type": "abort", "message": "Abort by user request", "status_code": None, "err_type": None}
        keep = []
        for req in self.waiting:
            (self._finish(req, reason) if hit(req) else keep.append(req))
        self.waiting = keep
        for req in [r for r in self.running.values() if hit(r)]:
            self._finish(req, reason)

    def _release(self, req: EngineRequest) -> None:
        if req.slot >= 0:
            self.running.pop(req.slot, None)
            self.runner.free(req.slot)
            heapq.heappush(self._free, req.slot)
            req.slot = -1

    def _finish(self, req: EngineRequest, reason: dict) -> None:
        self._release(req)
        if req.future.done():
            return
        meta = {
            "id": req.rid, "finish_reason": reason, "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids), "cached_tokens": 0,
        }
        # as SGLang 0.5.23: spans on every finished answer (also one that lived through no update), and
        # weight_version the last span's
        meta["weight_versions"] = weight_version_spans(req.version_events, self.weight_version, len(req.output_ids))
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
        if req.return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output_ids, repeat(None)))
        req.future.set_result(GenerateResponse(output_ids=req.output_ids, meta_info=MetaInfo(**meta)))

    @property
    def cache(self):
        return self.runner.cache

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Engine thread only, when idle (release_memory_occupation): free the KV cache and the weights (SGLang's
        tags; None: everything). Generation is refused until resume_memory."""
        if tags is None or "kv_cache" in tags:
            self.runner.release_cache()
        if tags is None or "weights" in tags:
            self.decoder.release_weights()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Allocate again what release_memory freed; released weights come back as zeros until the next load."""
        if tags is None or "weights" in tags:
            self.decoder.alloc_weights()
        if tags is None or "kv_cache" in tags:
            self.runner.alloc_cache()

    @property
    def released(self) -> bool:
        return self.runner.cache is None or not self.decoder.weights

    def _should_admit(self) -> bool:
        """Prefill in batches: wait (at most ADMIT_MAX_WAIT_STEPS decode steps) until about 1/8 of the
        running count is waiting, so most steps are pure decode instead of paying a prefill forward each."""
        if not self.waiting or not self._free:
            return False
        wanted = max(1, len(self.running) // ADMIT_BATCH_DIVISOR)
        admissible = min(len(self.waiting), len(self._free))
        return admissible >= wanted or self.steps - self._waiting_since >= ADMIT_MAX_WAIT_STEPS

    def _admit(self) -> list[EngineRequest]:
        batch: list[EngineRequest] = []
        longest = 0
        while self.waiting and self._free:
            req = self.waiting[0]
            if req.max_output == 0:  # nothing to generate: answer at once, no slot needed
                self.waiting.pop(0)
                self._finish(req, {"type": "length", "length": 0})
                continue
            longest_if = max(longest, len(req.tokens_so_far))
            if batch and longest_if * (len(batch) + 1) > self.prefill_token_budget:
                break
            self.waiting.pop(0)
            longest = longest_if
            req.slot = heapq.heappop(self._free)
            self.running[req.slot] = req
            batch.append(req)
        return batch

    def _prefill(self) -> None:
        batch = self._admit()
        if batch:
            out = self.runner.prefill([r.slot for r in batch], [r.tokens_so_far for r in batch],
                                      [r.params for r in batch], any(r.return_logprob for r in batch))
            self._append(batch, *out)

    def _decode(self) -> None:
        self.steps += 1
        batch = [self.running[s] for s in sorted(self.running)]
        out = self.runner.decode([r.slot for r in batch], [len(r.input_ids) + len(r.output_ids) for r in batch],
                                 [r.params for r in batch], any(r.return_logprob for r in batch))
        self._append(batch, *out)

    def _append(self, batch: list[EngineRequest], tokens: list[int], logprobs: list[float] | None) -> None:
        self.generated_tokens += len(batch)
        for i, req in enumerate(batch):
            tok = tokens[i]
            req.output_ids.append(tok)
            if req.return_logprob:
                req.logprobs.append(logprobs[i])
            n = len(req.output_ids)
            # SGLang 0.5.23's order (Req.update_finish_state): a stop string, then a stop token, then the length, so
            # a token that ends both reports the string, and an EOS on the last allowed position is a stop
            if req.stop_strings and (matched := matched_stop_string(req)) is not None:
                self._finish(req, {"type": "stop", "matched": matched})
            elif tok in req.stop_ids:
                self._finish(req, {"type": "stop", "matched": tok})
            elif n >= req.max_output:
                self._finish(req, {"type": "length", "length": n})


def weight_version_spans(events: list[tuple[int | str, int]], current: int | str, length: int) -> list[dict]:
    """A request's version events, the engine's version now and its output length -> SGLang's meta_info
    weight_versions: [{version: str, start, end}] over output positions [start, end), in order, covering them all
    (sglang/srt/utils/weight_versions.py: compute_weight_version_spans, then add_weight_versions_to_meta_info's
    visible spans). A version under which the request made no token gets no span (but a request with no output
    gets one empty span: the version now)."""
    spans: list[dict] = []
    for version, end in [*events, (current, length)]:
        version, end = str(version), min(end, length)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < length or s["start"] == 0]


def matched_stop_string(req: EngineRequest) -> str | None:
    """The first stop string in the text of the request's last output tokens, or None (as SGLang, the text
    of the output only: a string that starts in the prompt or an earlier partial round does not count)."""
    tail = req.decode(req.output_ids[-req.stop_tail_tokens:])
    return next((s for s in req.stop_strings if s in tail), None)
