"""The request codec between the dock and the engines: dock rows -> /generate requests, answers -> tokens, logprobs,
stop flags and weight versions. Requests and answers are rollout/sglang/protocol.py's types; the fleet that
answers them is rollout/contracts/fleet.py's Fleet.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..sglang.protocol import GenerateRequest, GenerateResponse, SamplingParams, WeightVersionSpan

@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None  # set: every request carries a sampling_seed (see request_seeds)
    stop: Sequence[str] = ()  # rollout.stop: stop strings (SGLang's sampling_params.stop)
    ignore_eos: bool = False  # rollout.ignore_eos: no EOS or stop token id ends a response

    @classmethod
    def from_rollout(cls, rollout_cfg, stop_token_ids: Sequence[int], seed: int | None = None) -> "SamplingSettings":
        """seed (model.seed) is used only with rollout.deterministic_sampling."""
        seed = seed if rollout_cfg.deterministic_sampling else None
        return cls(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k, tuple(stop_token_ids), seed,
                   tuple(rollout_cfg.stop), rollout_cfg.ignore_eos)


@dataclass
class GenerationStats:
    rounds: int = 0
    requests: int = 0
    tokens_generated: int = 0
    time_s: float = 0.0
    engine_s: float = 0.0  # inside the engine call (HTTP generation); the rest is dock bookkeeping
    ready_groups: int = 0
    detached_tokens: int = 0  # of tokens_generated: those the previous call's detached requests made (overlap)
    adopted_requests: int = 0  # the previous call's requests still running that this call took over (adopt_detached)
    weight_versions: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "requests": self.requests, "tokens_generated": self.tokens_generated,
                "generate_time_s": self.time_s, "engine_s": self.engine_s, "ready_groups": self.ready_groups,
                "detached_tokens": self.detached_tokens, "adopted_requests": self.adopted_requests}


def make_rids(count: int) -> list[str]:
    """count unique request ids: one random prefix and a fixed-width counter. SGLang matches request ids by
    prefix; ids of one fixed length never prefix one another."""
    prefix = secrets.token_hex(12)
    return [f"{prefix}{i:08x}" for i in range(count)]


def build_requests(inputs: Sequence[Sequence[int]], max_new_tokens: np.ndarray, sampling: SamplingSettings,
                   seeds: np.ndarray | None = None, extra_key: str | None = None) -> list[GenerateRequest]:
    """Dock inputs -> /generate requests (one per row); seeds[k] (optional) -> sampling_seed; extra_key (optional):
    SGLang's prefix-cache namespace of every request."""
    params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
              "stop_token_ids": list(sampling.stop_token_ids)}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    count = len(max_new_tokens)
    seeds = [None] * count if seeds is None else seeds.tolist()
    cache = {} if extra_key is None else {"extra_key": extra_key}
    return [GenerateRequest(input_ids=ids if isinstance(ids, list) else list(map(int, ids)),
                            sampling_params=SamplingParams(max_new_tokens=m, sampling_seed=seed, **params),
                            return_logprob=True, rid=rid, **cache)
            for ids, m, seed, rid in zip(inputs, np.asarray(max_new_tokens).tolist(), seeds, make_rids(count))]


def request_seeds(dock, rows: np.ndarray, sampling: SamplingSettings) -> np.ndarray | None:
    """Per-row sampling seeds from (sampling.seed, group id, sample index) -> int64[k] in [0, 2^31), or None
    when sampling is not seeded. The engine hashes the seed with each token's absolute position, so a row
    continued from its partial response draws exactly what one uninterrupted request would have drawn."""
    if sampling.seed is None:
        return None
    rows = np.asarray(rows, dtype=np.int64)
    return mix_seeds(sampling.seed, dock.group_ids[rows // dock.n], rows % dock.n)


def mix_seeds(seed: int, groups, indices) -> np.ndarray:
    """(seed, groups[k], indices[k]) -> int64[k] in [0, 2^31): one sampling seed per (group, sample index), the same
    in every run with this seed."""
    groups, indices = np.asarray(groups, dtype=np.int64), np.asarray(indices, dtype=np.int64)
    parts = (np.full(len(groups), seed), groups, indices)
    h = np.zeros(len(groups), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for part in parts:  # splitmix64 over the three parts (wrapping uint64 arithmetic)
            h = h ^ np.asarray(part).astype(np.int64).astype(np.uint64)
            h = h + np.uint64(0x9E3779B97F4A7C15)
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return (h & np.uint64(0x7FFFFFFF)).astype(np.int64)


def parse_responses(responses: Sequence[GenerateResponse], default_version: int
                    ) -> tuple[list[list[int]], list[list[float]], np.ndarray, np.ndarray | list[np.ndarray]]:
    """Answers -> (tokens per row, logprobs per row, finished_by_stop[bool], weight versions).

    Each token's version is what its answer's meta_info.weight_versions spans say (SGLang puts them on every
    finished answer; meta_info.weight_version only where an engine sends none). The versions are int64[k], one per
    row, unless an answer's tokens carry more than one version (it lived through a weight update): then a list of
    k int64 arrays, one version per output token (what TransferDock.put_generation takes either way)."""
    tokens, logprobs, stopped, versions = [], [], [], []
    spanned = False
    for resp in responses:
        meta = resp.meta_info
        ids = resp.output_ids
        lps = meta.logprobs
        if len(lps) != len(ids):
            raise ValueError(f"engine response {meta.id}: {len(ids)} output_ids but {len(lps)} logprobs")
        tokens.append(ids)
        logprobs.append(lps)
        stopped.append(meta.finish_reason.type == "stop")
        version = _as_version(meta.weight_version, default_version)
        per_token = token_versions(meta.weight_versions or (), len(ids), version, meta.id)
        if len(per_token) and (per_token != per_token[0]).any():
            spanned = True
            versions.append(per_token)
        else:  # one version for the whole answer: the spans' (an answer with no tokens: weight_version)
            versions.append(int(per_token[0]) if len(per_token) else version)
    if spanned:
        return tokens, logprobs, np.asarray(stopped, dtype=bool), [
            v if isinstance(v, np.ndarray) else np.full(len(t), v, dtype=np.int64) for v, t in zip(versions, tokens)]
    return tokens, logprobs, np.asarray(stopped, dtype=bool), np.asarray(versions, dtype=np.int64)


def token_versions(spans: Sequence[WeightVersionSpan], count: int, default: int, rid=None) -> np.ndarray:
    """SGLang's meta_info.weight_versions (spans over output positions [start, end)) -> int64[count], each output
    token's weight version. Positions no span covers take `default`, the response's weight_version."""
    out = np.full(count, default, dtype=np.int64)
    for span in spans:
        if not 0 <= span.start <= span.end <= count:
            raise ValueError(f"engine response {rid}: weight_versions span [{span.start}, {span.end}) lies outside "
                             f"its {count} output tokens")
        out[span.start:span.end] = _as_version(span.version, default)
    return out


def _as_version(version: int | str | None, default: int) -> int:
    """A parsed weight version (protocol.WeightVersion) that is no number ("default", none) -> default."""
    return version if isinstance(version, int) else default
