"""The learner's half of SGLang's distributed weight sync: rank 0 joins the engines' weight-update group as its
rank 0 and broadcasts the model's tensors bucket by bucket (rollout/fleet/distributed_weights.py drives the engines'
half: /init_weights_update_group once, /update_weights_from_distributed per bucket).

`WeightSenderMixin` is a base of `LearnerActor`, so these are actor methods of every rank. With FSDP every rank
takes part in gathering each bucket's full tensors (an all-gather per tensor, just before sending), so no rank
holds more than one bucket beyond its shards; rank 0 alone sends. Unsharded, the parameters are sent from their
own storage (no copy at all).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future

import torch

from spillover.infra.process_memory import peak_rss_bytes, reset_peak_rss
from spillover.rollout.sglang.update_group import (TensorSpec, destroy_group, dtype_name, init_group, send_bucket,
                                          tensor_digest)

__all__ = ["WeightSenderMixin", "for_engines", "full_tensor"]


def for_engines(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A learner tensor (or FSDP shard) as engines load it: in model.dtype (`dtype`), while the learner's masters are
    float32. Every tensor bound for an engine passes here (object store, HF folder, distributed and colocated
    buckets, digests); an FSDP shard is cast before its gather, so the gather moves the engines' bytes."""
    return tensor.detach().to(dtype)  # no copy when it is already dtype


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective: every rank calls it, in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class WeightSenderMixin:
    """Actor methods for the weight-update group. Needs self.model (the HF LM), self.state_keys, self.rank,
    self.weight_dtype (model.dtype: what engines load)."""

    def _named_weights(self) -> dict[str, torch.Tensor]:
        """The tensors engines load, as this rank holds them (DTensor shards when sharded), in model.dtype:
        references when the masters are already model.dtype, else cast copies (of the shards only, when sharded)."""
        state = self.model.state_dict()
        return {k: for_engines(state[k], self.weight_dtype) for k in self.state_keys}

    def weight_specs(self) -> list[TensorSpec]:
        """(HF name, dtype name, full shape) of every tensor the engines load, in sending order."""
        return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in self._named_weights().items()]

    def weight_sync_address(self) -> tuple[str, int]:
        """This rank's node address and a port free there: the group's rendezvous (rank 0's is used)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return host, sock.getsockname()[1]

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float = 600.0) -> bool:
        """Rank 0: start hosting the group as its rank 0 and return at once; the rendezvous completes in a thread
        when every engine has joined (broadcast_weights waits for it), so an engine that never joins blocks nothing
        but that thread (it gives up after timeout_s). Other ranks: no-op."""
        if backend == "nccl" and getattr(self, "device", "cpu") != "cuda":
            raise ValueError("engines.weight_sync=distributed with GPU engines broadcasts over NCCL, which needs "
                             "learner.device=cuda; use engines.weight_sync=tensor or disk for a CPU learner")
        if self.rank != 0:
            return False
        groups = self.__dict__.setdefault("_weight_groups", {})
        if group_name in groups:
            raise ValueError(f"weight-update group {group_name!r} is already joined")
        joined: Future = Future()

        def rendezvous() -> None:
            try:
                joined.set_result(init_group(master_address, master_port, 0, world_size, group_name, backend,
                                             timeout_s))
            except BaseException as err:  # noqa: BLE001 - reported through the future
                joined.set_exception(err)

        threading.Thread(target=rendezvous, name=f"weight-group-{group_name}", daemon=True).start()
        groups[group_name] = (joined, timeout_s)
        return True

    def _weight_group(self, group_name: str):
        entry = self.__dict__.get("_weight_groups", {}).get(group_name)
        if entry is None:
            raise ValueError(f"weight-update group {group_name!r} is not joined: join_weight_group first")
        joined, timeout_s = entry
        return joined.result(timeout=timeout_s)

    def leave_weight_group(self, group_name: str) -> bool:
        """Destroy the group (one still forming is destroyed if it ever forms)."""
        entry = self.__dict__.get("_weight_groups", {}).pop(group_name, None)
        if entry is None:
            return False
        entry[0].add_done_callback(lambda f: f.exception() is None and destroy_group(f.result()))
        return True

    def broadcast_weights(self, group_name: str, buckets: list[list[str]]) -> dict:
        """Every rank: gather each bucket's full tensors; rank 0 broadcasts them on the group, in order.
        -> {"bytes": sent, "buckets": count, "send_s", "peak_extra_bytes": the most tensor bytes held at once beyond
        the model (one bucket's gathered tensors; 0 unsharded, where the parameters go from their own storage)}."""
        group = self._weight_group(group_name) if self.rank == 0 else None
        named = self._named_weights()
        unknown = sorted({n for bucket in buckets for n in bucket} - set(named))
        if unknown:
            raise ValueError(f"broadcast_weights: unknown tensor names {unknown[:5]}")
        device = "cuda" if getattr(self, "device", "cpu") == "cuda" else "cpu"
        sent, peak, tic = 0, 0, time.perf_counter()
        with torch.no_grad():
            for bucket in buckets:
                tensors = [full_tensor(named[name]).to(device) for name in bucket]
                peak = max(peak, sum(t.numel() * t.element_size() for t, name in zip(tensors, bucket)
                                     if t is not named[name]))
                if self.rank == 0:
                    send_bucket(group, tensors)
                    sent += sum(t.numel() * t.element_size() for t in tensors)
                del tensors
        return {"bytes": sent, "buckets": len(buckets), "peak_extra_bytes": peak,
                "send_s": time.perf_counter() - tic, "pid": os.getpid()}

    def weight_digests(self) -> dict[str, str]:
        """sha256 of every tensor the engines load (sharded: gathered; rank 0's are the ones to compare)."""
        return {name: tensor_digest(full_tensor(t)) for name, t in self._named_weights().items()}

    def reset_peak_rss(self) -> int:
        return reset_peak_rss()

    def peak_rss(self) -> int:
        return peak_rss_bytes()
