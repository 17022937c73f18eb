"""Decoding responses and scoring them with a rule reward: pure helpers shared by the reward step
(tasks/reward.py) and evaluation (rollout/evaluation.py)."""
from __future__ import annotations

import math
from numbers import Real

import numpy as np

from rollout.sample import Sample


class RewardError(ValueError):
    """A reward function raised or returned something that is not a finite number."""


def decode_responses(samples: list[Sample], tokenizer, stop_token_ids) -> None:
    """Fill sample.response with the decoded text (a trailing stop token is not part of the text)."""
    stops = set(stop_token_ids)
    texts = batch_decode([s.response_tokens[:-1] if s.response_tokens and s.response_tokens[-1] in stops
                          else s.response_tokens for s in samples], tokenizer)
    for s, text in zip(samples, texts):
        s.response = text


def batch_decode(ids: list[list[int]], tokenizer) -> list[str]:
    """tokenizer.batch_decode(ids, skip_special_tokens=True). A fast tokenizer without space clean-up decodes
    to the same texts in one call to its Rust backend (HF's own loop costs ~15 us per sequence in Python)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    return backend.decode_batch(ids, skip_special_tokens=True)


def score_samples(samples: list[Sample], reward_fn, fn_path: str) -> np.ndarray:
    """Rule reward per sample -> float[len(samples)]; NaN, a non-number or an exception names the sample."""
    return score_responses([s.response for s in samples], [s.label for s in samples], reward_fn, fn_path,
                           describe=lambda i: _name(samples[i]), samples=samples)


def wants_samples(reward_fn) -> bool:
    """Does the reward function name a `sample` (or, batched, `samples`) parameter? Only then is it given
    Sample objects (building them costs per token)."""
    import inspect

    try:
        params = inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        return False
    return ("samples" if getattr(reward_fn, "batched", False) else "sample") in params


def score_responses(responses: list[str], labels: list, reward_fn, fn_path: str, describe, samples=None) -> np.ndarray:
    """Rule reward per response -> float64[k]. fn(response, label[, sample=...]) per response, or, for a
    function marked `batched = True`, fn(responses, labels[, samples=...]) once. describe(i) names response i
    in errors; samples (a sequence of Sample, or None) is passed only to functions that name it."""
    give = samples is not None and wants_samples(reward_fn)
    if getattr(reward_fn, "batched", False):
        extra = {"samples": samples} if give else {}
        values = _call(reward_fn, fn_path, "the batch", responses, labels, **extra)
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(responses):
            raise RewardError(f"reward function {fn_path!r} (batched) must return {len(responses)} numbers")
    else:
        values = [_call(reward_fn, fn_path, describe(i), r, label, **({"sample": samples[i]} if give else {}))
                  for i, (r, label) in enumerate(zip(responses, labels))]
    out = np.empty(len(responses), dtype=np.float64)
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (Real, np.floating, np.integer)) or not math.isfinite(float(v)):
            raise RewardError(f"reward function {fn_path!r} returned {v!r} for {describe(i)}; "
                              f"it must return a finite number")
        out[i] = float(v)
    return out


def _name(s: Sample) -> str:
    return f"sample {s.index} (group {s.group_index}, prompt {s.prompt[:40]!r})"


def _call(fn, fn_path, what, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # a user function: report which sample and which function
        raise RewardError(f"reward function {fn_path!r} raised on {what}: {type(err).__name__}: {err}") from err
