"""The torch engine's encoding of `/update_weights_from_tensor`'s `serialized_named_tensors` entries.

SGLang's entries are pickles (torch's ForkingPickler: CUDA IPC handles, unpickled through an allow-list) that only
a process on the same GPU node can use. The torch engine runs on CPU and unpickles nothing, so its stand-in is a
safetensors blob of the named tensors, base64 text: the same request shape (one entry per TP rank, base64
strings), data instead of handles. `spillover.rollout.sglang.backend.serialize_named_tensors` picks the encoding by
backend.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

__all__ = ["decode_named_tensors", "encode_named_tensors"]


def encode_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """[(name, tensor)] -> base64 text of one safetensors blob (CPU copies; tensors sharing storage, e.g. tied
    embeddings, are written apart, as safetensors requires)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"serialized_named_tensors: tensor {name!r} appears twice")
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # shared or partial storage: safetensors writes whole, unshared storages only
        seen.add(key)
        tensors[name] = t
    return base64.b64encode(save_safetensors(tensors)).decode("ascii")


def decode_named_tensors(entry: str | bytes) -> dict[str, torch.Tensor]:
    """One entry (base64 text of a safetensors blob) -> {name: CPU tensor}. Anything else raises ValueError
    naming the expected encoding (a pickle, SGLang's own encoding, is refused, never unpickled)."""
    try:
        raw = base64.b64decode(entry, validate=True)
        return load_safetensors(raw)
    except (binascii.Error, SafetensorError, ValueError) as err:
        raise ValueError("serialized_named_tensors: this torch engine takes each entry as base64 text of a "
                         "safetensors blob (spillover.rollout.sglang.backend.serialize_named_tensors(..., "
                         f"backend='torch')), not SGLang's CUDA IPC pickle: {err}") from err
