"""Decoding responses and scoring them with a rule reward: pure helpers shared by the reward step
(tasks/reward.py) and evaluation (rollout/drivers/evaluation.py)."""
from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from numbers import Real

import numpy as np

from ..sample import Sample


# what a user does about a reward function that failed mid-run: nothing after the last checkpoint is lost
REWARD_FIX = "fix it (grpo.reward_function_path), then `spillover resume RUN_DIR` goes on from the last checkpoint"


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


def score_samples(samples: list[Sample], reward_fn, fn_path: str, concurrency: int = 32,
                  timeout_s: float | None = None) -> np.ndarray:
    """Rule reward per sample -> float[len(samples)]; NaN, a non-number or an exception names the sample.
    A sample's metadata["data"] (its group's data.additional_keys) is the function's `metadata`."""
    return score_responses([s.response for s in samples], [s.label for s in samples], reward_fn, fn_path,
                           describe=lambda i: _name(samples[i]), samples=samples,
                           metadata=[s.metadata.get("data") for s in samples], concurrency=concurrency,
                           timeout_s=timeout_s)


def _params(reward_fn) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(reward_fn).parameters)
    except (TypeError, ValueError):
        return set()


def wants_samples(reward_fn) -> bool:
    """Does the reward function name a `sample` (or, batched, `samples`) parameter? Only then is it given
    Sample objects (building them costs per token)."""
    return ("samples" if getattr(reward_fn, "batched", False) else "sample") in _params(reward_fn)


def wants_metadata(reward_fn) -> bool:
    """Does the reward function name a `metadata` parameter (data.additional_keys of the response's group)?"""
    return "metadata" in _params(reward_fn)


def score_responses(responses: list[str], labels: list, reward_fn, fn_path: str, describe, samples=None,
                    metadata=None, concurrency: int = 32, timeout_s: float | None = None) -> np.ndarray:
    """Rule reward per response -> float64[k]. fn(response, label[, sample=...][, metadata=...]) per response,
    or, for a function marked `batched = True`, fn(responses, labels[, samples=...][, metadata=...]) once.
    describe(i) names response i in errors; samples (Sample per response, or None) and metadata (the group's
    data.additional_keys dict per response, or None) are passed only to functions that name them. An `async`
    function is awaited, at most `concurrency` calls at once (a remote verifier or sandbox). timeout_s
    (grpo.reward_timeout_s): a call that has not returned by then fails the scoring with a RewardError naming it (a
    plain function's call is left running in a daemon thread: Python cannot stop it)."""
    give = samples is not None and wants_samples(reward_fn)
    give_meta = wants_metadata(reward_fn)
    metadata = metadata if metadata is not None else [None] * len(responses)
    if getattr(reward_fn, "batched", False):
        extra = ({"samples": samples} if give else {}) | ({"metadata": list(metadata)} if give_meta else {})
        calls = [("the batch", (responses, labels), extra)]
    else:
        calls = [(describe(i), (r, label), ({"sample": samples[i]} if give else {}) |
                  ({"metadata": metadata[i]} if give_meta else {}))
                 for i, (r, label) in enumerate(zip(responses, labels))]
    if inspect.iscoroutinefunction(reward_fn):
        values = run_async_calls(reward_fn, fn_path, calls, concurrency, timeout_s)
    elif timeout_s is not None:
        values = _call_each_within(reward_fn, fn_path, calls, timeout_s)
    else:
        values = [_call(reward_fn, fn_path, what, *args, **kwargs) for what, args, kwargs in calls]
    if getattr(reward_fn, "batched", False):
        values = values[0]
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(responses):
            raise RewardError(f"reward function {fn_path!r} (batched) must return {len(responses)} numbers")
    out = np.empty(len(responses), dtype=np.float64)
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (Real, np.floating, np.integer)) or not math.isfinite(float(v)):
            raise RewardError(f"reward function {fn_path!r} returned {v!r} for {describe(i)}; "
                              f"it must return a finite number: {REWARD_FIX}")
        out[i] = float(v)
    return out


def run_async_calls(fn, fn_path: str, calls: list, concurrency: int, timeout_s: float | None = None) -> list:
    """Await fn(*args, **kwargs) for every (what, args, kwargs), at most `concurrency` at once, each within timeout_s
    (None: no limit); -> results in order. Runs its own event loop (in a helper thread when this thread already
    runs one)."""
    async def one(gate, what, args, kwargs):
        async with gate:
            try:
                return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
            except asyncio.TimeoutError:
                raise _timed_out(fn_path, what, timeout_s) from None
            except Exception as err:  # a user function: report which sample and which function
                raise _raised(fn_path, what, err) from err

    async def gather():
        gate = asyncio.Semaphore(max(1, int(concurrency)))
        return await asyncio.gather(*(one(gate, *call) for call in calls))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with ThreadPoolExecutor(1, thread_name_prefix="reward-async") as pool:
        return pool.submit(asyncio.run, gather()).result()


def _name(s: Sample) -> str:
    return f"sample {s.index} (group {s.group_index}, prompt {s.prompt[:40]!r})"


def _timed_out(fn_path: str, what: str, timeout_s: float) -> RewardError:
    return RewardError(f"reward function {fn_path!r} did not return within grpo.reward_timeout_s={timeout_s:g} s on "
                       f"{what}; {REWARD_FIX} (or raise grpo.reward_timeout_s)")


def _call_each_within(fn, fn_path: str, calls: list, timeout_s: float) -> list:
    """The plain function's calls one after another in a daemon thread, each awaited here for at most timeout_s."""
    answers: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        for what, args, kwargs in calls:
            if stop.is_set():
                return
            try:
                answers.put((True, _call(fn, fn_path, what, *args, **kwargs)))
            except RewardError as err:
                answers.put((False, err))

    threading.Thread(target=work, daemon=True, name="reward-calls").start()
    out = []
    try:
        for what, _, _ in calls:
            try:
                ok, value = answers.get(timeout=timeout_s)
            except queue.Empty:
                raise _timed_out(fn_path, what, timeout_s) from None
            if not ok:
                raise value
            out.append(value)
    finally:
        stop.set()
    return out


def _raised(fn_path: str, what: str, err: Exception) -> RewardError:
    return RewardError(f"reward function {fn_path!r} raised on {what}: {type(err).__name__}: {err}; {REWARD_FIX}")


def _call(fn, fn_path, what, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # a user function: report which sample and which function
        raise _raised(fn_path, what, err) from err
