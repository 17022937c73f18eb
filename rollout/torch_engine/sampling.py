"""Token sampling for a batch of rows with per-row parameters (SGLang semantics).

Logprobs are log_softmax(logits / T) of the chosen token, before top-k/top-p/min-p filtering; a greedy
row (temperature 0) takes the argmax and reports log_softmax(logits) (SGLang treats T=0 as T=1, top_k=1).

A row with a seed (SGLang's `sampling_params.sampling_seed`) is sampled by Gumbel-max with noise hashed
from (seed, position, token id): its token depends on nothing else (not the batch, not the timing), so
the same request gives the same sample in any batch, on any engine, after any restart.
"""
from __future__ import annotations

import torch

GREEDY_EPS = 1e-6


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h):
    """murmur3's fmix32 finaliser on 32-bit values (int64 tensors or Python ints)."""
    if isinstance(h, int):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _M32
        return h ^ (h >> 16)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """A request's sampling_seed (any int) -> a well-mixed 32-bit key."""
    seed &= (1 << 64) - 1
    return _mix32(_mix32((seed & _M32) ^ 0x9E3779B9) ^ (seed >> 32))


def seeded_gumbel_argmax(logprobs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling with counter-based noise: logprobs [B, V] (-inf = not allowed), keys [B] (seed_key),
    positions [B] (absolute position of the token being sampled) -> tokens [B].

    Noise for (row, token) is a hash of (key, position, token id), so a row's sample does not depend on the
    other rows, the batch order or any generator state."""
    row = _mix32(keys.to(torch.int64) ^ _mix32(positions.to(torch.int64) & _M32))
    cols = torch.arange(logprobs.shape[-1], device=logprobs.device, dtype=torch.int64)
    bits = _mix32(_mix32(row.unsqueeze(1) ^ cols.unsqueeze(0)) ^ row.unsqueeze(1))
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1)
    gumbel = -torch.log(-torch.log(uniform))
    return (logprobs.to(torch.float64) + gumbel).argmax(-1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  min_p: torch.Tensor, all_greedy: bool, needs_filter: bool,
                  generator: torch.Generator | None, seed_keys: torch.Tensor | None = None,
                  seeded: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32), per-row params [B] -> (tokens [B] long, logprobs [B] fp32).

    all_greedy / needs_filter are host-side flags so the common cases skip work without a device sync.
    seed_keys [B] / seeded [B] bool / positions [B] (all or none): rows with seeded=True are sampled by
    `seeded_gumbel_argmax` from the same (filtered) distribution.
    """
    if all_greedy:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, logprobs
    greedy = temperature <= GREEDY_EPS
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    logprobs_all = torch.log_softmax(scaled, -1)
    probs = logprobs_all.exp()
    if needs_filter:
        sorted_probs, order = probs.sort(-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1])).unsqueeze(1)
        drop = ranks >= k
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) > top_p.unsqueeze(1)
        drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        picked = torch.multinomial(sorted_probs, 1, generator=generator)
        sampled = order.gather(1, picked).squeeze(1)
        if seeded is not None:
            allowed = torch.zeros_like(probs).scatter_(1, order, sorted_probs).log()  # vocab order, -inf dropped
    else:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        allowed = logprobs_all
    if seeded is not None:
        sampled = torch.where(seeded, seeded_gumbel_argmax(allowed, seed_keys, positions), sampled)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
