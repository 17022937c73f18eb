"""Eval: generate responses for each eval data set, score them, and log slime's eval metrics.

Engine-agnostic: `fleet.generate(jobs) -> answers` takes /generate jobs (rollout/sglang/protocol.py: GenerateJob)
and returns their answers in order (rollout/contracts/fleet.py). Metrics per data set key, as in slime's log_eval_data: `eval/<key>` (mean reward), `eval/<key>-truncated_ratio`, plus `eval/step`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..contracts.fleet import Fleet
from .requests import SamplingSettings, build_requests, mix_seeds, parse_responses
from ..sglang.protocol import GenerateJob, GenerateResponse
from ..sample import Sample, Status
from ..scoring.rule_reward import decode_responses, score_samples



class PromptSetLike(Protocol):
    texts: list[str]
    labels: list[Any]
    tokens: list[list[int]]


class EvalAborted(RuntimeError):
    """An eval response came back aborted (abort_all during eval): its metrics would be wrong."""


def eval_step(rollout_id: int, train_step: int, use_train_step: bool) -> int:
    """The x-axis of eval metrics (eval/step): the rollout id, or the train step when configured."""
    return train_step if use_train_step else rollout_id


def eval_metrics(key: str, groups: list[list[Sample]]) -> dict[str, float]:
    """Scored samples of one eval set -> {eval/<key>: mean reward, eval/<key>-truncated_ratio}."""
    flat = [s for g in groups for s in g]
    if not flat:
        raise ValueError(f"eval data set {key!r} produced no samples")
    rewards = [s.get_reward_value() for s in flat]
    return {f"eval/{key}": float(np.mean(rewards)),
            f"eval/{key}-truncated_ratio": float(np.mean([s.status == Status.TRUNCATED for s in flat]))}


def eval_log_dict(results: Mapping[str, list[list[Sample]]], step: int) -> dict[str, float]:
    """Every data set's metrics and eval/step, ready for the tracker."""
    out: dict[str, float] = {}
    for key, groups in results.items():
        out.update(eval_metrics(key, groups))
    out["eval/step"] = step
    return out


def run_eval(datasets: Mapping[str, PromptSetLike], fleet: Fleet, reward_fn: Callable, *,
             tokenizer, stop_token_ids: Sequence[int], max_new_tokens: int, max_model_len: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1, n_samples_per_prompt: int = 1,
             reward_fn_path: str = "grpo.reward_function_path", stop: Sequence[str] = (), seed: int | None = None
             ) -> dict[str, list[list[Sample]]]:
    """Generate n responses per prompt of every data set (one fleet.generate call for all), decode and score them.

    -> {key: groups}, group g = prompt g of that set, with n scored samples. temperature 0 is greedy.
    A response is TRUNCATED when it ended by length without a stop token, COMPLETED otherwise. seed (the run's
    model.seed under rollout.deterministic_sampling): every request gets a sampling_seed from (seed, data set, prompt,
    sample), so two evals of one policy draw the same responses.
    """
    if n_samples_per_prompt < 1 or max_new_tokens < 1:
        raise ValueError(f"eval needs n_samples_per_prompt >= 1 and max_new_tokens >= 1; got "
                         f"{n_samples_per_prompt} and {max_new_tokens}")
    samples: list[Sample] = []
    budgets: list[int] = []
    set_of_sample: list[int] = []
    results: dict[str, list[list[Sample]]] = {}
    for ordinal, (key, data) in enumerate(datasets.items()):
        results[key] = []
        for g, (text, label, ids) in enumerate(zip(data.texts, data.labels, data.tokens)):
            budget = max_new_tokens if max_model_len is None else min(max_new_tokens, max_model_len - len(ids))
            if budget < 1:
                raise ValueError(f"eval data set {key!r}: prompt #{g + 1} has {len(ids)} tokens, leaving no room "
                                 f"under rollout.max_model_len ({max_model_len})")
            data_keys = {"data": data.metadata[g]} if getattr(data, "metadata", None) else {}  # data.additional_keys
            group = [Sample(g, i, list(ids), label=label, prompt=text, metadata=dict(data_keys))
                     for i in range(n_samples_per_prompt)]
            results[key].append(group)
            samples += group
            budgets += [budget] * n_samples_per_prompt
            set_of_sample += [ordinal] * n_samples_per_prompt
    if not samples:
        return results
    sampling = SamplingSettings(temperature, top_p, top_k, tuple(stop_token_ids), stop=tuple(stop))
    seeds = None if seed is None else mix_seeds(
        seed, (np.asarray(set_of_sample) << 32) + [s.group_index for s in samples], [s.index for s in samples])
    requests = build_requests([s.prompt_tokens for s in samples], np.array(budgets), sampling, seeds)
    responses = fleet.generate([GenerateJob(request) for request in requests])
    if len(responses) != len(samples):
        raise RuntimeError(f"the fleet returned {len(responses)} answers for {len(samples)} eval requests")
    tokens, logprobs, _, versions = parse_responses(responses, default_version=-1)
    stops = set(stop_token_ids)
    for s, resp, ids, lps, version in zip(samples, responses, tokens, logprobs, versions):
        s.append_segment(ids, lps, int(version))
        s.status = _status(resp, ids, stops)
    decode_responses(samples, tokenizer, stop_token_ids)
    for s, reward in zip(samples, score_samples(samples, reward_fn, reward_fn_path)):
        s.reward = float(reward)
    return results


def _status(response: GenerateResponse, ids: list[int], stops: set[int]) -> Status:
    kind = response.meta_info.finish_reason.type
    if kind == "abort":
        raise EvalAborted(f"eval request {response.meta_info.id} was aborted after {len(ids)} tokens "
                          "(engines aborted during eval); run eval again when no abort is pending")
    if kind == "length" and not (ids and ids[-1] in stops):  # an EOS on the last allowed position reports length
        return Status.TRUNCATED
    return Status.COMPLETED
