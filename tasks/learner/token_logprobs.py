"""Response-token logprobs without a [batch, sequence, vocabulary] logits tensor.

The model body runs to hidden states [B, L, H]; only the N positions that predict a response token are
gathered ([N, H]); those are projected with the lm_head and log_softmax'ed (and their entropy taken) in chunks
of `chunk_tokens` rows. Peak logprob memory is chunk x V instead of B x L x V (151k vocabularies: 0.6 GB per
1k tokens in fp32, instead of tens of GB per micro-batch). With gradients on, each chunk runs under activation
checkpointing, so backward keeps only the [chunk, H] inputs, not the [chunk, V] log-probabilities.

`ResponseLogprobModel` is an nn.Module so that FSDP2 can make it the root (`fully_shard`): the root's hooks
gather the embedding, final norm and lm_head around this forward, the body's decoder layers are sharded
one by one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["ResponseLogprobModel", "chunked_token_logprobs"]


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden[n, H], weight[V, H], targets[n]) -> (logprob[n], entropy[n], 0s when not asked) in float32."""
    logits = F.linear(hidden, weight, bias).float()
    logp = torch.log_softmax(logits.div_(temperature) if temperature != 1.0 else logits, dim=-1)  # 2 x [n, V] at most
    picked = torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked, torch.zeros_like(picked)
    with torch.no_grad():  # a metric: never differentiated
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return picked, entropy


def chunked_token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                           chunk_tokens: int, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(hidden) / T) at targets, chunk by chunk: (hidden[N, H], targets[N]) -> (logp[N], entropy[N]).

    Equal to log_softmax over the full head(hidden) (tests/reference_logprobs.py) up to float rounding; the largest
    tensor it makes is [chunk_tokens, V]."""
    if chunk_tokens < 1:
        raise ValueError(f"learner.logprob_chunk_tokens must be >= 1; got {chunk_tokens}")
    weight, bias = head.weight, getattr(head, "bias", None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, hidden.size(0), chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if grad:  # recompute the [chunk, V] softmax in backward instead of keeping it for every chunk
            lp, ent = checkpoint(_chunk_logprobs, h, weight, bias, t, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, weight, bias, t, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent.detach())
    if not logps:  # no response position (rows with no response token): nothing to score
        empty = hidden.new_zeros(0, dtype=torch.float32)
        if grad:  # still a graph to every weight, so backward (and each FSDP rank's collectives in it) runs
            empty = empty + (hidden.sum() + weight.sum()).float() * 0
        return empty, empty.detach()
    return torch.cat(logps), torch.cat(entropies)


class ResponseLogprobModel(torch.nn.Module):
    """An HF causal LM that returns response-token logprobs [B, R] (and entropy [B, R]) instead of logits."""

    def __init__(self, lm: torch.nn.Module, temperature: float, chunk_tokens: int):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for logprobs; got {temperature}")
        self.lm, self.temperature, self.chunk_tokens = lm, float(temperature), int(chunk_tokens)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, logit_positions: torch.Tensor,
                targets: torch.Tensor, response_mask: torch.Tensor, with_entropy: bool = False,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0):
        """Padded: (input_ids[B, L], attention_mask[B, L]); packed: (input_ids[1, T], position_ids[1, T],
        cu_seqlens int32[B + 1], max_seqlen), attention_mask None; both with (logit_positions[B, R] (packed: into the
        row), targets[B, R], response_mask[B, R]) -> (logp[B, R], entropy[B, R]) float32, 0 where response_mask is 0."""
        body = self.lm.get_decoder()
        if cu_seqlens is None:
            hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        else:  # the varlen arguments reach every layer's attention (tasks/learner/packed_attention.py)
            hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu_seqlens,
                          cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen).last_hidden_state
        rows, cols = torch.nonzero(response_mask > 0, as_tuple=True)
        positions = logit_positions[rows, cols]
        # only positions that predict a response token: [N, H]
        picked = hidden[rows, positions] if cu_seqlens is None else hidden[0, positions]
        logp_flat, ent_flat = chunked_token_logprobs(picked, self.lm.get_output_embeddings(), targets[rows, cols],
                                                     self.temperature, self.chunk_tokens, with_entropy)
        shape = response_mask.shape
        logp = torch.zeros(shape, dtype=torch.float32, device=hidden.device).index_put((rows, cols), logp_flat)
        entropy = torch.zeros(shape, dtype=torch.float32, device=hidden.device).index_put((rows, cols), ent_flat)
        return logp, entropy
