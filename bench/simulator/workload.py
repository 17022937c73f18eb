"""What the simulated engine generates: prompts that name their group, natural response lengths per
(group, sample), and SGLang-shaped answers.

A simulated prompt is `[PROMPT_MARK, group_id, prompt_length, FILL, ...]`, so the engine knows a request's
group and where its response starts from the token ids alone (what a real engine sees). The first
response token of a sample is `SAMPLE_KEY_BASE + j`, its index in the group: a continued partial row
carries it in its input ids and keeps its natural length. j is handed out when a fresh request of the
group is first admitted (lowest free index first; returned if it is aborted before its first token).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...rollout.sglang.protocol import GenerateResponse, MetaInfo

PROMPT_MARK = 3
FILL_TOKEN = 7
SAMPLE_KEY_BASE = 1_000_000
DEFAULT_EOS = 2
LOGPROB = -1.0  # every simulated token reports this rollout logprob


def simulated_prompt(group_id: int, length: int) -> list[int]:
    """The prompt of group `group_id`, `length` (>= 3) tokens long."""
    if length < 3:
        raise ValueError(f"simulated_prompt: length must be >= 3 (mark, group id, length); got {length}")
    return [PROMPT_MARK, int(group_id), int(length)] + [FILL_TOKEN] * (length - 3)


def parse_simulated_input(input_ids: Sequence[int]) -> tuple[int, int, int | None]:
    """input ids -> (group id, prompt length, sample index j or None for a fresh request)."""
    if len(input_ids) < 3 or input_ids[0] != PROMPT_MARK or not 3 <= input_ids[2] <= len(input_ids):
        raise ValueError("simulated engine: input_ids must start with a prompt built by simulated_prompt() "
                         f"([{PROMPT_MARK}, group_id, prompt_length, ...]); got {list(input_ids[:3])}...")
    group, plen = int(input_ids[1]), int(input_ids[2])
    if len(input_ids) == plen:
        return group, plen, None
    j = int(input_ids[plen]) - SAMPLE_KEY_BASE
    if j < 0:
        raise ValueError(f"simulated engine: group {group}: the response does not start with a sample key "
                         f"(token {input_ids[plen]}); continue partial rows from the ids the engine returned")
    return group, plen, j


@dataclass(frozen=True)
class LognormalLengths:
    """Natural response lengths: ceil(lognormal(log(median), sigma)), at least 1, drawn per group from a
    generator seeded by (seed, group id), so every run with the same seed sees the same lengths. Lengths
    above a request's budget end by the length limit (no EOS): that is the cap at max_tokens.

    group_share in [0, 1): the share of the log-length variance that belongs to the prompt (a hard prompt's
    responses are all long): log length = log(median) + sigma (sqrt(share) z_group + sqrt(1 - share) z_sample),
    so the marginal lengths stay lognormal(median, sigma). 0 (the default): the samples of a group are
    independent, and a group's finished responses say nothing about the rest."""

    n: int
    median: float = 2000.0
    sigma: float = 1.0
    seed: int = 0
    group_share: float = 0.0

    def group_lengths(self, group_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(group_id)])
        if self.group_share:
            z = np.sqrt(self.group_share) * rng.normal() + np.sqrt(1 - self.group_share) * rng.normal(size=self.n)
            raw = np.ceil(self.median * np.exp(self.sigma * z))
        else:
            raw = np.ceil(rng.lognormal(np.log(self.median), self.sigma, self.n))
        return np.maximum(raw, 1).astype(np.int64)


@dataclass(frozen=True)
class RecurringLengths:
    """Natural lengths of prompts that recur across epochs (the bench's --workload recurring): group g asks prompt
    g % num_prompts, whose difficulty (a standard normal z_prompt, seeded by (seed, prompt)) holds every epoch.

    log length = log(median) + sigma (sqrt(prompt_share) z_prompt + sqrt(group_share - prompt_share) z_group
    + sqrt(1 - group_share) z_sample): a group's samples share group_share of the variance, of which prompt_share is
    the prompt's own and comes back next epoch (what a per-prompt history of lengths can learn); the marginal
    lengths stay lognormal(median, sigma)."""

    n: int
    num_prompts: int
    median: float = 2000.0
    sigma: float = 1.0
    seed: int = 0
    group_share: float = 0.5
    prompt_share: float = 0.4

    def __post_init__(self):
        if not 0 <= self.prompt_share <= self.group_share < 1 or self.num_prompts < 1:
            raise ValueError("RecurringLengths: need 0 <= prompt_share <= group_share < 1 and num_prompts >= 1")

    def prompt_of(self, group_id: int) -> int:
        return int(group_id) % self.num_prompts

    def group_lengths(self, group_id: int) -> np.ndarray:
        z_prompt = np.random.default_rng([self.seed, 1, self.prompt_of(group_id)]).normal()
        rng = np.random.default_rng([self.seed, int(group_id)])
        z = (np.sqrt(self.prompt_share) * z_prompt + np.sqrt(self.group_share - self.prompt_share) * rng.normal()
             + np.sqrt(1 - self.group_share) * rng.normal(size=self.n))
        return np.maximum(np.ceil(self.median * np.exp(self.sigma * z)), 1).astype(np.int64)


@dataclass(frozen=True)
class TableLengths:
    """Natural lengths given per group (tests and hand-computed cases)."""

    table: Mapping[int, Sequence[int]]

    def group_lengths(self, group_id: int) -> np.ndarray:
        if group_id not in self.table:
            raise KeyError(f"TableLengths: no lengths for group {group_id}")
        return np.asarray(self.table[group_id], dtype=np.int64)


def response_tokens(start: int, count: int, j: int, ends_with_eos: bool, eos: int) -> tuple[list[int], list[tuple]]:
    """Positions start .. start+count-1 of sample j -> (output_ids, output_token_logprobs).

    Position 0 is the sample key, the last position of a sample that stops is EOS, the rest FILL.
    """
    ids = [FILL_TOKEN] * count
    entries = [(LOGPROB, FILL_TOKEN, None)] * count
    if count and start == 0:
        ids[0] = SAMPLE_KEY_BASE + j
        entries[0] = (LOGPROB, ids[0], None)
    if count and ends_with_eos:
        ids[-1] = eos
        entries[-1] = (LOGPROB, eos, None)
    return ids, entries


def answer(rid: str, prompt_tokens: int, ids: list[int], entries: list[tuple] | None, finish: str, eos: int,
           weight_version, latency_s: float, spans: list[tuple[int, int, int]] | None = None) -> GenerateResponse:
    """One /generate answer; spans (version, start, end) over output positions: the request lived through a weight
    update (meta_info.weight_versions)."""
    reason: dict = {"type": finish}
    if finish == "stop":
        reason["matched"] = eos
    elif finish == "length":
        reason["length"] = len(ids)
    else:
        reason["message"] = "aborted (abort_all)"
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
            "weight_version": weight_version, "output_token_logprobs": entries, "e2e_latency": latency_s}
    if spans:
        meta["weight_versions"] = [{"version": str(v), "start": start, "end": end} for v, start, end in spans]
    return GenerateResponse(output_ids=ids, meta_info=MetaInfo(**meta))
