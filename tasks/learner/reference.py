"""The KL reference inside the policy's ranks (learner.reference_placement=with_policy or with_policy_offloaded).

The reference is the run's initial model, frozen: loaded from the policy's model folder and wrapped and sharded as
the policy is (tasks/learner/distributed.py `logprob_net`), with no gradients and no optimizer state. Each rank runs
it over the same micro-batches of the same rows as a reference group of its own would, so its logprobs are the ones
that group computes. Nothing of it goes into checkpoints: a resumed run loads it from the model folder again.

Offloaded (`HostCopy`): its parameter storages are copied once into host memory (pinned on CUDA). The reference
never changes, so offloading copies nothing: the device storages are freed (the parameters keep their shapes and
hold no memory) and, for each reference pass, allocated again and filled from the host copy.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ...infra.config.learner import LearnerConfig
from .distributed import load_learner_lm, logprob_net

__all__ = ["HostCopy", "ReferenceModel"]


class HostCopy:
    """The parameter storages of a frozen module, each once (tied parameters share one; a sharded parameter's is this
    rank's padded shard), copied into host memory: `release` frees them on the device, `restore` brings them back."""

    def __init__(self, module: torch.nn.Module):
        found: dict[int, torch.UntypedStorage] = {}
        for param in module.parameters():
            if not hasattr(param, "to_local") and not param.untyped_storage().resizable():
                # unsharded weights as loaded (a storage the file reader owns, which cannot be freed): a copy of
                # their own; FSDP2's shards are its own allocations already
                param.data = param.data.clone()
            storage = (param.to_local() if hasattr(param, "to_local") else param).untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), storage)
        self.storages = list(found.values())
        pinned = any(s.device.type == "cuda" for s in self.storages)  # pinned: copies back at the bus's speed
        self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pinned) for s in self.storages]
        for storage, host in zip(self.storages, self.host):
            host.untyped_storage().copy_(storage)

    def release(self) -> None:
        """Free the device storages. The module must not run until `restore`; callers have read its results (a
        device-to-host copy waits for the kernels that read the weights)."""
        for storage in self.storages:
            storage.resize_(0)

    def restore(self) -> None:
        """Allocate the storages again and copy the weights in (on CUDA on the current stream, which FSDP2's
        gathers wait for at the root's forward)."""
        for storage, host in zip(self.storages, self.host):
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)


class ReferenceModel:
    """The frozen reference of one policy rank: `net` computes response logprobs as the policy's net does."""

    def __init__(self, model_path: str, lcfg: LearnerConfig, temperature: float, sharded: bool, device: str):
        self.net = logprob_net(load_learner_lm(model_path, lcfg), lcfg, temperature, sharded, device, trainable=False)
        self.sharded = sharded
        self.offload = HostCopy(self.net) if lcfg.reference_placement == "with_policy_offloaded" else None
        if self.offload is not None:
            self.offload.release()

    @contextmanager
    def in_use(self) -> Iterator[torch.nn.Module]:
        """The reference's net, its weights on the device for the block; afterwards its FSDP2 root's gathered
        weights are freed (the root keeps them after a forward) and an offloaded one's shards released."""
        if self.offload is not None:
            self.offload.restore()
        try:
            yield self.net
        finally:
            if self.sharded:
                self.net.reshard()
            if self.offload is not None:
                self.offload.release()
