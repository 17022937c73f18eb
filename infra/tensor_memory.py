"""Count the tensors torch ops allocate in a region: the largest one and the peak of live bytes.

A TorchDispatchMode sees every op's outputs (CPU or GPU, no allocator statistics needed). Bytes are counted per
storage (a view adds nothing) from the op that makes them until the last tensor on that storage dies. Inputs that
existed before the region (weights, the batch) are not counted: this measures what a computation adds.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorMemoryProbe"]


class TensorMemoryProbe(TorchDispatchMode):
    """with TensorMemoryProbe() as probe: ...  -> probe.peak_bytes, probe.largest_bytes, probe.largest_shape."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.refs: dict[int, int] = {}  # storage address -> live tensors counted on it
        self.live_bytes = self.peak_bytes = self.largest_bytes = 0
        self.largest_shape: tuple[int, ...] = ()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled under the probe. The default (True) wraps __torch_dispatch__ in torch._disable_dynamo,
        # whose first call imports torch._dynamo: ~1.2 CPU-s in every engine process, at its first weight load.
        return False

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live_bytes -= self.live.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or (key in inputs and key not in self.live):  # a view of (or in-place on) older memory
                continue
            if key not in self.live:
                self.live[key], self.refs[key] = nbytes, 0
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                if nbytes > self.largest_bytes:
                    self.largest_bytes, self.largest_shape = nbytes, tuple(tensor.shape)
            self.refs[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out
