"""Logprobs and entropy from full [B, T, V] logits: the plain computation that the learner's chunked one
(tasks/learner/token_logprobs.py) must equal, and the memory baseline it is measured against."""
from __future__ import annotations

import torch


def full_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at the target ids: (logits[B, T, V], targets[B, T]) -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)


def full_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position: [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
