"""The tensor side of the engine: the KV cache, per-slot state, and one forward + sample per step.

The batcher (batcher.py) decides which requests run in which slots; this runner turns a list of slots
into tokens. Slot state lives in tensors on the engine's device: `slot_len` (tokens in the cache),
`slot_token` (the next token to feed) and the sampling parameters of the request in the slot.
"""
from __future__ import annotations

import torch

from .attn_plan import plan_attention
from .lean_forward import AttnGroup, KVCache, LeanDecoder
from ..sglang.protocol import SamplingParams
from .sampling import GREEDY_EPS, sample_tokens, seed_key

StepOutput = tuple[list[int], list[float] | None]  # sampled token per row, and its logprob (if wanted)


class SlotRunner:
    def __init__(self, decoder: LeanDecoder, num_slots: int, max_len: int, seed: int = 0):
        self.decoder, self.device = decoder, decoder.device
        self.num_slots, self.max_len = num_slots, max_len
        self.reseed(seed)
        self.cache: KVCache | None = None
        self.alloc_cache()
        n, dev = num_slots, self.device
        self._all_rows = torch.arange(n, device=dev)
        self._zeros = torch.zeros(n, dtype=torch.long, device=dev)
        self._ones = torch.ones(n, dtype=torch.long, device=dev)
        self.slot_len = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_token = torch.zeros(n, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(n, device=dev)
        self.top_p = torch.ones(n, device=dev)
        self.top_k = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.min_p = torch.zeros(n, device=dev)
        self.seed_key = torch.zeros(n, dtype=torch.long, device=dev)  # sampling_seed, hashed (see sampling.py)
        self.seeded = torch.zeros(n, dtype=torch.bool, device=dev)

    def reseed(self, seed: int) -> None:
        """The unseeded rows' random stream, as at start (a new object: a step in progress keeps the old one)."""
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def alloc_cache(self) -> None:
        if self.cache is None:
            d = self.decoder
            self.cache = KVCache(d.shape, self.num_slots, self.max_len, d.dtype, d.device)

    def release_cache(self) -> None:
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def cache_bytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for t in [*self.cache.k, *self.cache.v])

    def free(self, slot: int) -> None:
        """An idle slot feeds token 0 at position 0 (harmless: a new request prefills from 0)."""
        self.slot_len[slot] = 0
        self.slot_token[slot] = 0

    def prefill(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                want_logprobs: bool) -> StepOutput:
        """Run the prompts (right padded) into their slots and sample each one's first token."""
        dev = self.device
        lengths = [len(p) for p in prompts]
        T = max(lengths)
        tokens = torch.zeros(len(prompts), T, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            tokens[i, :lengths[i]] = torch.tensor(prompt)
        slot_t = torch.tensor(slots, device=dev)
        positions = torch.arange(T, device=dev).expand(len(prompts), T)
        last = torch.tensor(lengths, device=dev) - 1
        logits = self.decoder.forward(tokens.to(dev), positions, self.cache, slot_t, None, last_index=last)
        self.temperature[slot_t] = torch.tensor([p.temperature for p in params], device=dev)
        self.top_p[slot_t] = torch.tensor([p.top_p for p in params], device=dev)
        self.top_k[slot_t] = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        self.min_p[slot_t] = torch.tensor([p.min_p for p in params], device=dev)
        seeds = [p.sampling_seed for p in params]
        self.seeded[slot_t] = torch.tensor([s is not None for s in seeds], device=dev)
        self.seed_key[slot_t] = torch.tensor([seed_key(s) if s is not None else 0 for s in seeds], device=dev)
        self.slot_len[slot_t] = torch.tensor(lengths, device=dev)
        return self._sample(slot_t, logits, params, want_logprobs)

    def decode(self, slots: list[int], kv_lens: list[int], params: list[SamplingParams],
               want_logprobs: bool) -> StepOutput:
        """One token for each slot (ascending); kv_lens[i]: keys slot i reads (its length + 1)."""
        use_view, plan = plan_attention(slots, kv_lens)
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        if use_view:  # rows [0, hi) through one view of the cache; idle slots ride along
            hi = slots[-1] + 1
            tokens, positions, write_rows = self.slot_token[:hi], self.slot_len[:hi], self._all_rows[:hi]
            groups = [AttnGroup(None, slice(0, hi), plan[0][1])]
        else:
            tokens, positions = self.slot_token.index_select(0, slot_t), self.slot_len.index_select(0, slot_t)
            write_rows = slot_t
            if len(plan) == 1:
                groups = [AttnGroup(None, slot_t, plan[0][1])]
            else:
                groups = []
                for index, kv_len in plan:
                    index_t = torch.tensor(index, device=dev)
                    groups.append(AttnGroup(index_t, slot_t.index_select(0, index_t), kv_len))
        B = tokens.shape[0]
        logits = self.decoder.forward(tokens.view(B, 1), positions.view(B, 1), self.cache, write_rows, groups,
                                      last_index=self._zeros[:B])
        if B > len(slots):
            logits = logits.index_select(0, slot_t)
        self.slot_len.index_add_(0, slot_t, self._ones[:len(slots)])
        return self._sample(slot_t, logits, params, want_logprobs)

    def _sample(self, slot_t: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams],
                want_logprobs: bool) -> StepOutput:
        all_greedy = all(p.temperature <= GREEDY_EPS for p in params)
        needs_filter = any(p.top_p < 1 or p.top_k > 0 or p.min_p > 0 for p in params)
        if all_greedy:
            per_row = (None, None, None, None)
        else:
            per_row = tuple(t.index_select(0, slot_t) for t in (self.temperature, self.top_p, self.top_k, self.min_p))
        seeded = () if all_greedy or all(p.sampling_seed is None for p in params) else tuple(
            t.index_select(0, slot_t) for t in (self.seed_key, self.seeded, self.slot_len))  # slot_len: new token's position
        tokens, logprobs = sample_tokens(logits, *per_row, all_greedy, needs_filter, self.generator, *seeded)
        self.slot_token.index_copy_(0, slot_t, tokens)
        return tokens.tolist(), (logprobs.tolist() if want_logprobs else None)
