"""What the tests read from, or ask of, a running fleet that a run never does: an engine's weight-update events and
the peak of its weight loads (read inside the engine's process through Ray's `actor.__ray_call__.remote(reader)`,
from its EngineActor or from the learner rank that hosts a colocated one), a health check now, whether the health
monitor runs, and released memory resumed. The last three reach the RolloutManager's own members, as the manager
tests do."""
from __future__ import annotations

import sys

import ray.cloudpickle

# Ray's workers cannot import this module (tests/ is on no worker's sys.path): the readers travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def take_weight_update_events(engine) -> list[str]:
    """Inside an EngineActor (torch backend): the engine's weight-update session and route outcomes since the last
    take, in order (begin_weight_update, update_weights_from_tensor, ..., end_weight_update; "... refused" /
    "... failed")."""
    events = list(engine.server.weight_update_events)
    engine.server.weight_update_events.clear()
    return events


def take_update_peak_bytes(engine) -> int:
    """Inside an EngineActor (torch backend): the most one weight load held beyond the model since the last take
    (the incoming tensors, e.g. a received bucket, plus what loading them allocated)."""
    peak, engine.server.update_peak_bytes = engine.server.update_peak_bytes, 0
    return peak


def watch_held_tensor_bytes(engine) -> None:
    """Inside an EngineActor (torch backend): from now on, as each weight load begins, note the bytes of every tensor
    alive in this process (counted per storage, through the garbage collector's objects: no allocator statistics)
    beyond those alive now, which include the engine's own weights and KV cache. take_held_tensor_bytes reads them."""
    import gc

    import torch

    def storages() -> dict[int, int]:
        found = (o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta")
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}

    server, baseline, held = engine.server, set(storages()), []
    apply = server.apply_weights_future

    def watched(*args, **kwargs):
        held.append(sum(n for ptr, n in storages().items() if ptr not in baseline))
        return apply(*args, **kwargs)

    server.apply_weights_future, server.held_tensor_bytes = watched, held


def take_held_tensor_bytes(engine) -> list[int]:
    """Inside an EngineActor watched by watch_held_tensor_bytes: what each load held beyond the start; stops
    watching."""
    server = engine.server
    held = server.held_tensor_bytes
    del server.apply_weights_future, server.held_tensor_bytes  # the class's method again
    return held


def on_hosted_engine(learner, read, *args):
    """Inside a learner rank that hosts a colocated engine (placement.colocate): read(its EngineActor, *args)."""
    return read(learner.engine_host.engine, *args)


def health_check(manager) -> dict[int, str]:
    """Probe every engine's /health_generate now, as the health monitor does (restarting dead or hung ones):
    index -> ok | restarted | released."""
    return manager._call(manager._health_check)


def health_monitor_running(manager) -> bool:
    return manager._monitor is not None and not manager._monitor.done()


def resume_memory(manager) -> None:
    """Resume what RolloutManager.offload released, as a colocated weight update does before it loads: released
    weights come back empty, so load some next."""
    manager._call(manager._memory, False, None)


def fail_sends_after(actor_self, sends: int | None) -> None:
    """In a learner rank's process: its broadcasts' sends fail after `sends` more (None: sends work again)."""
    from spillover.tasks.learner import weight_sender

    original = weight_sender.__dict__.setdefault("working_send_bucket", weight_sender.send_bucket)
    if sends is None:
        weight_sender.send_bucket = original
        return
    left = {"sends": sends}

    def failing(group, tensors):
        left["sends"] -= 1
        if left["sends"] < 0:
            raise RuntimeError("rank 0's send failed")
        return original(group, tensors)

    weight_sender.send_bucket = failing
