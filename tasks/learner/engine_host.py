"""Colocated engines (placement.colocate): each policy learner rank hosts one rollout engine in its own process,
as verl's hybrid engine does; the engine and the learner take turns with the device (MindSpeed-RL's / slime's
colocated mode): the manager releases the engines' memory before logprobs and update, resumes it afterwards,
and the new weights go to each engine bucket by bucket.

A rank that hosts one holds an `EngineHost` (LearnerActor.engine_host; the actor's engine methods forward to it):
- host(...): a spillover.rollout.fleet.engine_actor.EngineActor in this process (torch backend: the torch engine's
  HTTP server on a thread of this process; sglang: its server process on this rank's GPU, fate-shared with it).
  rollout/fleet/colocated_pool.py routes the engine pool's actor calls to LearnerActor.engine_call.
- load_weights(sender, version, bucket_bytes): every rank gathers each bucket's full tensors (FSDP shards; a
  collective), and a hosting rank posts them to its engine's /update_weights_from_tensor inside one weight-update
  session (SGLang: CUDA IPC handles; the torch engine: the tensors' data, which it copies into its own, resumed
  weights). No rank holds more than one bucket beyond its model.
- take_log(): this process's memory release/resume, logprob, update and weight-load events in order (the
  colocation test reads it).
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from ...rollout.sglang.update_group import plan_buckets
from .weight_sender import WeightSender, full_tensor

if TYPE_CHECKING:  # imported where an engine is hosted: a rank that hosts none never loads the engine's code
    from ...rollout.fleet.engine_actor import EngineActor

__all__ = ["EngineHost"]


class EngineHost:
    """The engine this rank hosts (none until host()), and the events of this process while it does."""

    def __init__(self) -> None:
        self.engine: EngineActor | None = None
        self._events: list[tuple[float, str]] = []

    def note(self, event: str) -> None:
        """An event of this process, for take_log (kept only while an engine is hosted)."""
        if self.engine is not None:
            self._events.append((time.monotonic(), event))

    def host(self, backend: str, model_path: str, engine_index: int, **engine_kwargs: Any) -> dict:
        """Build engine engine_index in this process (replacing a hosted one); returns its info()."""
        from ...rollout.fleet.engine_actor import EngineActor

        self.drop()
        self.engine = EngineActor(backend, model_path, engine_index, **engine_kwargs)
        return self.engine.info()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            raise RuntimeError(f"engine_call({name!r}): this learner rank hosts no engine (host_engine first)")
        return getattr(self.engine, name)(*args, **kwargs)

    def drop(self) -> None:
        """Stop the hosted engine's server and forget it."""
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def load_weights(self, sender: WeightSender, weight_version: int, bucket_bytes: int) -> dict:
        """This rank's part of a colocated sync (every rank calls it): the model's tensors to the hosted engine,
        bucket by bucket, inside one weight-update session (ended also on failure); the last bucket sets
        weight_version. -> {"buckets", "bytes", "version"}."""
        named = sender.named_weights()
        buckets = plan_buckets(sender.specs(), bucket_bytes)
        # Only an engine's node 0 serves HTTP. The torch engine takes the buckets over HTTP too, although it runs in
        # this process: that costs a few copies of one bucket (encoded, decoded), never of the model, and runs the
        # session and route that SGLang needs, so the CPU suite exercises them.
        poster = self.engine.poster() if self.engine is not None and self.engine.url is not None else None
        loaded, failure = 0, None
        # a failed begin or post is raised once every bucket is gathered: the gathers are collectives every rank
        # must join, or the others wait for this one and pair with the next sync's
        with torch.no_grad(), ExitStack() as session:
            if poster is not None:
                try:
                    session.enter_context(poster.session())
                except Exception as err:
                    failure = err
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                tensors = {name: full_tensor(named[name]).to(sender.device) for name, _, _ in bucket}  # a collective
                if poster is not None and failure is None:
                    try:
                        poster.post_bucket(tensors, weight_version if last else None, flush_cache=last)
                        loaded += sum(t.numel() * t.element_size() for t in tensors.values())
                    except Exception as err:
                        failure = err
                del tensors
            if failure is not None:
                raise failure  # inside the session: it is ended as after any failure
        if str(sender.device).startswith("cuda"):  # the buckets' cached blocks back to the device: the engine's
            torch.cuda.empty_cache()               # KV cache is resumed next (rollout/fleet/manager.py)
        version = poster.reported_version() if poster is not None else None
        self.note("load_weights")
        return {"buckets": len(buckets), "bytes": loaded, "version": version}

    def take_log(self) -> list[str]:
        """The events of this process since the last take, in time order: release / resume (the hosted engine's
        memory), compute_ref_logprobs, compute_logprobs, update, load_weights."""
        events, self._events = self._events, []
        server = self.engine.server if self.engine is not None else None
        if server is not None:
            events, server.memory_events = events + server.memory_events, []
        return [event for _, event in sorted(events)]
