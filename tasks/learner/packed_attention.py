"""Attention over a packed row (tasks/learner/micro_batches.py): causal within each sequence, never across.

transformers passes the model's keyword arguments down to the attention function of every layer, so the packed
forward (tasks/learner/token_logprobs.py) hands over the sequence boundaries as flash attention's varlen arguments
(`cu_seq_lens_q/k`, `max_length_q/k`). With learner.attn_implementation=flash_attention_2, transformers' own flash
path reads them (flash_attn's varlen kernel). With sdpa or eager, the learner's model runs `packed_attention` below,
registered with transformers as PACKED ("spillover_packed"), which needs no [T, T] mask:

- CUDA, bfloat16/float16: torch's own varlen flash attention (torch.nn.attention.varlen, no extra package);
- otherwise (CPU, float32): scaled_dot_product_attention with is_causal per sequence, which on CPU is the fused
  flash kernel over that sequence only.

transformers' sdpa path could take the packing from the position ids alone, but it would build a dense [T, T]
block-diagonal mask and attend over all T^2 pairs; here the work is each sequence's own L^2 / 2.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

__all__ = ["PACKED", "packed_attention", "use_packed_attention"]
PACKED = "spillover_packed"
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)  # looked up (and warned about) once per process, not once per layer
def _varlen():
    """torch's varlen flash attention, or None where this torch has none (its signature moved between releases:
    causal as window_size=(-1, 0) or as is_causal; GQA as enable_gqa or not at all)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.warning("torch.nn.attention.varlen is missing: packed attention runs sequence by sequence")
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _varlen_attention(query, key, value, cu_seqlens, max_seqlen: int, scaling: float | None):
    """(query[T, Hq, D], key/value[T, Hkv, D]) -> [T, Hq, D] with torch's varlen flash kernel, or None without one."""
    found = _varlen()
    if found is None:
        return None
    varlen_attn, params = found
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        causal["enable_gqa"] = key.size(1) != query.size(1)
    elif key.size(1) != query.size(1):  # this torch's kernel wants as many key/value heads as query heads
        key = key.repeat_interleave(query.size(1) // key.size(1), dim=1)
        value = value.repeat_interleave(query.size(1) // value.size(1), dim=1)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scaling, **causal)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over one packed row: (query[1, Hq, T, D], key/value[1, Hkv, T, D],
    cu_seq_lens_q int32[S + 1]) -> ([1, T, Hq, D], None). Without cu_seq_lens_q the row is one sequence."""
    if attention_mask is not None or query.size(0) != 1:
        raise ValueError("packed attention takes one packed row (batch 1) and no attention mask")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention has no sliding window: set learner.pack_sequences=false for this model")
    total = query.size(2)
    cu = cu_seq_lens_q if cu_seq_lens_q is not None else torch.tensor([0, total], dtype=torch.int32)
    # under autocast the rotary embedding leaves query and key in float32 (float32 cos/sin): flash wants one half dtype
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    if query.is_cuda and dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
        out = _varlen_attention(q, k, v, cu.to(query.device), int(max_length_q or total), scaling)
        if out is not None:
            return out.unsqueeze(0), None
    bounds = cu.tolist()  # on CUDA one host sync per layer: the fallback only
    gqa = key.size(1) != query.size(1)
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                           scale=scaling, enable_gqa=gqa) for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_packed_attention(lm: torch.nn.Module) -> None:
    """Make the model's sdpa / eager attention `packed_attention` (flash_attention_2 packs by itself). Registering a
    name in transformers' table is idempotent; the model's choice is its own config's."""
    from transformers import AttentionInterface

    if lm.config._attn_implementation == "flash_attention_2":
        return
    AttentionInterface.register(PACKED, packed_attention)
    lm.set_attn_implementation(PACKED)
