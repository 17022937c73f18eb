"""Partial-rollout generation over the dock: the sync driver (rounds of max_tokens // max_split).

The engine side is anything with `generate(requests) -> list[response]` speaking SGLang's /generate
shapes (RolloutManager through the router, or a simulated engine).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np


class Generator(Protocol):
    def generate(self, requests: list[dict]) -> list[dict]: ...


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None  # set: every request carries a sampling_seed (see request_seeds)

    @classmethod
    def from_rollout(cls, rollout_cfg, stop_token_ids: Sequence[int], seed: int | None = None) -> "SamplingSettings":
        """seed (model.seed) is used only with rollout.deterministic_sampling."""
        seed = seed if getattr(rollout_cfg, "deterministic_sampling", False) else None
        return cls(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k, tuple(stop_token_ids), seed)


@dataclass
class GenerationStats:
    rounds: int = 0
    requests: int = 0
    tokens_generated: int = 0
    time_s: float = 0.0
    engine_s: float = 0.0  # inside the engine call (HTTP generation); the rest is dock bookkeeping
    ready_groups: int = 0
    weight_versions: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "requests": self.requests, "tokens_generated": self.tokens_generated,
                "generate_time_s": self.time_s, "engine_s": self.engine_s, "ready_groups": self.ready_groups}


def make_rids(count: int) -> list[str]:
    """count unique request ids: one random prefix and a fixed-width counter. SGLang matches request ids by
    prefix; ids of one fixed length never prefix one another."""
    prefix = secrets.token_hex(12)
    return [f"{prefix}{i:08x}" for i in range(count)]


def build_requests(inputs: Sequence[Sequence[int]], max_new_tokens: np.ndarray, sampling: SamplingSettings,
                   seeds: np.ndarray | None = None) -> list[dict]:
    """Dock inputs -> SGLang /generate payloads (one per row); seeds[k] (optional) -> sampling_seed."""
    params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
              "stop_token_ids": list(sampling.stop_token_ids)}
    requests = [{
        "input_ids": ids if isinstance(ids, list) else list(map(int, ids)),
        "sampling_params": {"max_new_tokens": m, **params},
        "return_logprob": True,
        "rid": rid,
    } for ids, m, rid in zip(inputs, np.asarray(max_new_tokens).tolist(), make_rids(len(max_new_tokens)))]
    if seeds is not None:
        for request, seed in zip(requests, seeds.tolist()):
            request["sampling_params"]["sampling_seed"] = seed
    return requests


def request_seeds(dock, rows: np.ndarray, sampling: SamplingSettings) -> np.ndarray | None:
    """Per-row sampling seeds from (sampling.seed, group id, sample index) -> int64[k] in [0, 2^31), or None
    when sampling is not seeded. The engine hashes the seed with each token's absolute position, so a row
    continued from its partial response draws exactly what one uninterrupted request would have drawn."""
    if sampling.seed is None:
        return None
    rows = np.asarray(rows, dtype=np.int64)
    parts = (np.full(len(rows), sampling.seed), dock.group_ids[rows // dock.n], rows % dock.n)
    h = np.zeros(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for part in parts:  # splitmix64 over the three parts (wrapping uint64 arithmetic)
            h = h ^ np.asarray(part).astype(np.int64).astype(np.uint64)
            h = h + np.uint64(0x9E3779B97F4A7C15)
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return (h & np.uint64(0x7FFFFFFF)).astype(np.int64)


def parse_responses(responses: list[dict], default_version: int) -> tuple[list[list[int]], list[list[float]],
                                                                          np.ndarray, np.ndarray]:
    """SGLang responses -> (tokens per row, logprobs per row, finished_by_stop[bool], weight_version[int] per row)."""
    tokens, logprobs, stopped, versions = [], [], [], []
    for resp in responses:
        meta = resp["meta_info"]
        ids = list(resp.get("output_ids") or [])
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise ValueError(f"engine response {meta.get('id')}: {len(ids)} output_ids but {len(lps)} logprobs")
        tokens.append(ids)
        logprobs.append(lps)
        stopped.append((meta.get("finish_reason") or {}).get("type") == "stop")
        versions.append(_as_version(meta.get("weight_version"), default_version))
    return tokens, logprobs, np.asarray(stopped, dtype=bool), np.asarray(versions, dtype=np.int64)


def _as_version(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def generate_until_ready_sync(dock, engine: Generator, rollout_cfg, sampling: SamplingSettings,
                              weight_version: int, drain: bool = False,
                              on_round: Callable[[dict], None] | None = None) -> GenerationStats:
    """Rounds of max_tokens // max_split new tokens per row until >= GBS groups are ready (drain: all rows).

    Each round takes up to GBS x n rows from the dock (carried-over rows first, oldest first).
    With max_split = 1 a round generates whole responses: plain GRPO.
    """
    round_tokens = rollout_cfg.max_tokens // rollout_cfg.max_split
    rows_per_round = rollout_cfg.global_batch_size * rollout_cfg.n_samples_per_prompt
    dock.set_drain(drain)
    stats = GenerationStats()
    start = time.perf_counter()
    while not dock.update_ready():
        rows = dock.take_rows(limit=rows_per_round)
        if len(rows) == 0:
            raise RuntimeError(f"generation cannot finish: no row left to generate but only "
                               f"{dock.ready_group_count()} groups are ready (need {rollout_cfg.global_batch_size})")
        inputs, max_new = dock.generation_inputs(rows, round_tokens)
        requests = build_requests(inputs, max_new, sampling, request_seeds(dock, rows, sampling))
        try:
            engine_start = time.perf_counter()
            responses = engine.generate(requests)
            stats.engine_s += time.perf_counter() - engine_start
            tokens, logprobs, stopped, version = parse_responses(responses, weight_version)
        except BaseException:
            dock.release(rows)  # the rows go back untouched: nothing half-written
            raise
        dock.put_generation(rows, tokens, logprobs, version, stopped)
        stats.rounds += 1
        stats.requests += len(rows)
        stats.tokens_generated += sum(len(t) for t in tokens)
        stats.ready_groups = dock.ready_group_count()
        if on_round:
            on_round({"round": stats.rounds, "ready_groups": stats.ready_groups,
                      "target_groups": rollout_cfg.global_batch_size, "tokens": stats.tokens_generated,
                      "elapsed_s": time.perf_counter() - start})
    stats.time_s = time.perf_counter() - start
    return stats


def generate_batch(dock, engine: Generator, rollout_cfg, stop_token_ids, weight_version: int, drain: bool,
                   on_round: Callable[[dict], None] | None = None, seed: int | None = None) -> GenerationStats:
    """Generate until the dock is ready (sync or async mode), then choose the training batch once.
    seed: model.seed, used with rollout.deterministic_sampling."""
    from rollout.partial_async import generate_until_ready_async

    sampling = SamplingSettings.from_rollout(rollout_cfg, stop_token_ids, seed)
    driver = generate_until_ready_async if rollout_cfg.mode == "async" else generate_until_ready_sync
    stats = driver(dock, engine, rollout_cfg, sampling, weight_version, drain, on_round)
    dock.select_batch()
    return stats


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The default rollout function (seed signature): partial rollout over the run's dock.

    args: the RunConfig; data_source: the run (dock, engine, weight_version, ...). Training: the GBS
    groups the dock chose (generation stats go to the iteration's metrics). evaluation=True: every data set
    of data.eval_paths, generated greedily once per prompt -> {key: groups}.
    """
    if evaluation:
        return _evaluate(args, data_source)
    drain = rollout_id == args.schedule.num_iterations - 1
    stats = generate_batch(data_source.dock, data_source.engine, args.rollout, data_source.stop_token_ids,
                           data_source.weight_version, drain, getattr(data_source, "on_round", None), args.model.seed)
    if getattr(data_source, "current", None) is not None:
        data_source.current.metrics.update(stats.as_dict())
    return data_source.dock.batch_samples()


def _evaluate(args, data_source) -> dict:
    from rollout.data_source import read_prompts
    from rollout.evaluation import run_eval

    if getattr(data_source, "eval_sets", None) is None:
        max_prompt = args.rollout.max_model_len - args.rollout.max_tokens
        data_source.eval_sets = {key: read_prompts(path, data_source.tokenizer, max_prompt, args.data.prompt_key,
                                                   args.data.label_key, args.data.over_long_prompts)
                                 for key, path in args.data.eval_paths.items()}
    return run_eval(data_source.eval_sets, data_source.engine.generate, data_source.reward_fn,
                    tokenizer=data_source.tokenizer, stop_token_ids=data_source.stop_token_ids,
                    max_new_tokens=args.rollout.max_tokens, max_model_len=args.rollout.max_model_len,
                    temperature=0.0, top_p=1.0, top_k=-1,  # greedy: eval measures the policy's best guess
                    reward_fn_path=args.grpo.reward_function_path)
