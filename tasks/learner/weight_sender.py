"""The learner's half of SGLang's distributed weight sync: rank 0 joins the engines' weight-update group as its
rank 0 and broadcasts the model's tensors bucket by bucket (DistributedWeights in rollout/fleet/weights/fleet_weights.py drives
the engines' half: /init_weights_update_group once, /update_weights_from_distributed per bucket).

Every rank holds a `WeightSender` (LearnerActor.weight_sender; the actor's weight methods forward to it). With FSDP
every rank takes part in gathering each bucket's full tensors (an all-gather per tensor, just before sending), so no
rank holds more than one bucket beyond its shards; rank 0 alone sends. Unsharded, the parameters are sent from their
own storage (no copy at all).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future

import torch

from ...rollout.sglang.update_group import TensorSpec, destroy_group, dtype_name, init_group, send_bucket

__all__ = ["WeightSender", "for_engines", "full_tensor"]


def for_engines(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A learner tensor (or FSDP shard) as engines load it: in model.dtype (`dtype`), while the learner's masters are
    float32. Every tensor bound for an engine passes here (object store, HF folder, distributed and colocated
    buckets, digests); an FSDP shard is cast before its gather, so the gather moves the engines' bytes."""
    return tensor.detach().to(dtype)  # no copy when it is already dtype


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective: every rank calls it, in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class WeightSender:
    """One rank's weights as engines load them, and its side of the weight-update groups. model: the HF LM (its
    state dict holds DTensor shards when sharded); state_keys: the names engines load; weight_dtype: model.dtype."""

    def __init__(self, model: torch.nn.Module, state_keys: list[str], rank: int, weight_dtype: torch.dtype,
                 device: str):
        self.model, self.state_keys, self.rank = model, state_keys, rank
        self.weight_dtype, self.device = weight_dtype, device
        self._groups: dict[str, tuple[Future, float]] = {}  # group name -> (the rendezvous, its timeout)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The tensors engines load, as this rank holds them (DTensor shards when sharded), in model.dtype:
        references when the masters are already model.dtype, else cast copies (of the shards only, when sharded)."""
        state = self.model.state_dict()
        return {k: for_engines(state[k], self.weight_dtype) for k in self.state_keys}

    def specs(self) -> list[TensorSpec]:
        """(HF name, dtype name, full shape) of every tensor the engines load, in sending order."""
        return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in self.named_weights().items()]

    def join(self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
             timeout_s: float = 600.0) -> bool:
        """Rank 0: start hosting the group as its rank 0 and return at once; the rendezvous completes in a thread
        when every engine has joined (broadcast waits for it), so an engine that never joins blocks nothing
        but that thread (it gives up after timeout_s). Other ranks: no-op."""
        if backend == "nccl" and self.device != "cuda":
            raise ValueError("engines.weight_sync=distributed with GPU engines broadcasts over NCCL, which needs "
                             "learner.device=cuda; use engines.weight_sync=tensor or disk for a CPU learner")
        if self.rank != 0:
            return False
        if group_name in self._groups:
            raise ValueError(f"weight-update group {group_name!r} is already joined")
        joined: Future = Future()

        def rendezvous() -> None:
            try:
                joined.set_result(init_group(master_address, master_port, 0, world_size, group_name, backend,
                                             timeout_s))
            except BaseException as err:  # noqa: BLE001 - reported through the future
                joined.set_exception(err)

        threading.Thread(target=rendezvous, name=f"weight-group-{group_name}", daemon=True).start()
        self._groups[group_name] = (joined, timeout_s)
        return True

    def _group(self, group_name: str):
        entry = self._groups.get(group_name)
        if entry is None:
            raise ValueError(f"weight-update group {group_name!r} is not joined: join_weight_group first")
        joined, timeout_s = entry
        return joined.result(timeout=timeout_s)

    def leave(self, group_name: str) -> bool:
        """Destroy the group (one still forming is destroyed if it ever forms)."""
        entry = self._groups.pop(group_name, None)
        if entry is None:
            return False
        entry[0].add_done_callback(lambda f: f.exception() is None and destroy_group(f.result()))
        return True

    def broadcast(self, group_name: str, buckets: list[list[str]]) -> dict:
        """Every rank: gather each bucket's full tensors; rank 0 broadcasts them on the group, in order.
        -> {"bytes": sent, "buckets": count, "send_s", "peak_extra_bytes": the most tensor bytes held at once beyond
        the model (one bucket's gathered tensors; 0 unsharded, where the parameters go from their own storage)}."""
        named = self.named_weights()
        unknown = sorted({n for bucket in buckets for n in bucket} - set(named))
        if unknown:
            raise ValueError(f"broadcast_weights: unknown tensor names {unknown[:5]}")
        # rank 0's failure (its group, a send) is raised once every bucket is gathered: the other ranks' gathers are
        # collectives it must still join, or they wait for it and pair with the next sync's
        group, failure = None, None
        if self.rank == 0:
            try:
                group = self._group(group_name)
            except Exception as err:
                failure = err
        sent, peak, tic = 0, 0, time.perf_counter()
        with torch.no_grad():
            for bucket in buckets:
                tensors = [full_tensor(named[name]).to(self.device) for name in bucket]
                peak = max(peak, sum(t.numel() * t.element_size() for t, name in zip(tensors, bucket)
                                     if t is not named[name]))
                if self.rank == 0 and failure is None:
                    try:
                        send_bucket(group, tensors)
                        sent += sum(t.numel() * t.element_size() for t in tensors)
                    except Exception as err:
                        failure = err
                del tensors
        if failure is not None:
            raise failure
        return {"bytes": sent, "buckets": len(buckets), "peak_extra_bytes": peak,
                "send_s": time.perf_counter() - tic, "pid": os.getpid()}


def free_address() -> tuple[str, int]:
    """This node's address and a port free there: a group's rendezvous (rank 0's is used)."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return host, sock.getsockname()[1]
