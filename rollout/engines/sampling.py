"""Token sampling for a batch of rows with per-row parameters (SGLang semantics).

Logprobs are log_softmax(logits / T) of the chosen token, before top-k/top-p/min-p filtering; a greedy
row (temperature 0) takes the argmax and reports log_softmax(logits) (SGLang treats T=0 as T=1, top_k=1).
"""
from __future__ import annotations

import torch

GREEDY_EPS = 1e-6


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  min_p: torch.Tensor, all_greedy: bool, needs_filter: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32), per-row params [B] -> (tokens [B] long, logprobs [B] fp32).

    all_greedy / needs_filter are host-side flags so the common cases skip work without a device sync.
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
    else:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
