"""Kill -9 and resume, end to end: `spillover train` as a subprocess SIGKILLs itself when a chosen task of
iteration 1 starts (SPILLOVER_KILL_AT, infra/faults.py), `spillover resume RUN_DIR` finishes the run, and
the result is the uninterrupted run's: every prompt group trained exactly once and the final checkpoint's
policy tensors (weights, AdamW state, torch RNG) bit-identical.

Determinism needs three settings (DETERMINISTIC below): rollout.deterministic_sampling (every request
carries a sampling_seed, so tokens do not depend on batching, timing or the engine), and old logprobs from
the learner without truncated IS (grpo.skip_old_logprob=false, grpo.tis=false): the CPU engine's logprobs
are equal only up to ~1e-7 across batch compositions, which would reach the weights through the loss.

The killed run must leave no process behind: each subprocess gets a unique SPILLOVER_PROC_TAG in its
environment, which every descendant inherits (Ray's raylet and workers, engine actors, the router), and
/proc is searched for it. Found on these machines: Ray's workers and agents (engine actors, an idle
worker, the dashboard and runtime-env agents) outlive the SIGKILL by a few seconds and then exit on their
own, so the check waits for them; anything still there after the grace period fails the test and is
SIGKILLed in teardown.

All subprocesses share one Prefect server (prefect_test_harness, started once for the module): an
ephemeral server per process costs ~10-25 s here and timed out under load.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TAG_ENV = "SPILLOVER_PROC_TAG"
SEVEN_TASKS = ["load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob",
               "compute_old_logprob", "update", "clear_and_age_sort"]
SMALL = ["schedule.num_iterations=3", "rollout.global_batch_size=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_tokens=16", "rollout.max_model_len=32", "rollout.max_split=2", "grpo.micro_batch_size=16",
         "tracking.wandb_mode=disabled", "tracking.progress=false", "data.num_prompts=64",
         "engines.max_running_requests=32", "engines.rollout_num_gpus=1"]
DETERMINISTIC = ["rollout.deterministic_sampling=true", "grpo.skip_old_logprob=false", "grpo.tis=false",
                 "grpo.reward_function_path=test_kill_resume.distinct_chars"]
LEFTOVER_GRACE_S = 60.0


def distinct_chars(response: str, label, **_) -> float:
    """A reward that varies within a group (the tiny model never solves the built-in task), so that every
    update moves the weights and a wrong resume would show in them."""
    return len(set(response)) / 16.0


# ---- seeded sampling (the engine half of determinism; fast) ------------------------------------------

def _generate(url: str, requests: list[dict]) -> list[list[int]]:
    from rollout.engines.client import EngineClient

    async def go():
        async with EngineClient(url) as client:
            answers = await asyncio.gather(*[client.generate(r["input_ids"], r["sampling_params"]) for r in requests])
            return [a.output_ids for a in answers]
    return asyncio.run(go())


def test_seeded_sampling_ignores_batching_engine_and_splitting(sglang_router, torch_engines):
    """Through the real router onto two engines whose own generators are seeded differently: a request with
    a sampling_seed gets the same tokens alone or among others, on either engine, and continued from half
    of its response; without the seed the engines disagree."""
    prompt = [5, 6, 7, 8, 9]
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    seeded = {**params, "sampling_seed": 1234}
    alone = _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": seeded}])[0]
    others = [{"input_ids": [20 + i, 3, 4 + i], "sampling_params": {**params, "sampling_seed": i}} for i in range(6)]
    mixed = _generate(sglang_router.url, others[:3] + [{"input_ids": prompt, "sampling_params": seeded}] * 4 + others[3:])
    assert mixed[3:7] == [alone] * 4  # round robin: both engines served it, in different batches
    first = _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": {**seeded, "max_new_tokens": 7}}])[0]
    rest = _generate(sglang_router.url, [{"input_ids": prompt + first,
                                          "sampling_params": {**seeded, "max_new_tokens": 9}}])[0]
    assert first + rest == alone  # the noise is keyed by absolute position: partial rollout changes nothing
    assert _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": {**seeded, "sampling_seed": 99}}])[0] != alone
    direct = [_generate(engine.url, [{"input_ids": prompt, "sampling_params": params}])[0] for engine in torch_engines]
    assert direct[0] != direct[1]  # unseeded: each engine's own generator decides


def test_request_seeds_come_from_group_and_sample_not_from_the_round():
    import numpy as np

    from rollout.dock import TransferDock
    from rollout.partial import SamplingSettings, build_requests, request_seeds

    dock = TransferDock(gbs=2, n=2, max_split=2, max_tokens=8, max_model_len=16, eos_token_ids=[1])
    dock.load_groups([10, 11], [[5, 6], [7, 8]], [0, 0])
    rows = dock.take_rows()
    sampling = SamplingSettings(seed=3)
    seeds = request_seeds(dock, rows, sampling)
    assert len(set(seeds.tolist())) == 4 and all(0 <= s < 2**31 for s in seeds.tolist())
    dock.put_generation(rows, [[9, 9]] * 4, [[-1.0, -1.0]] * 4, 0, np.zeros(4, dtype=bool))
    assert request_seeds(dock, dock.take_rows(), sampling).tolist() == seeds.tolist()  # next round: same seeds
    assert request_seeds(dock, rows, SamplingSettings(seed=4)).tolist() != seeds.tolist()
    assert request_seeds(dock, rows, SamplingSettings()) is None
    requests = build_requests([[5]] * 4, np.full(4, 2), sampling, seeds)
    assert [r["sampling_params"]["sampling_seed"] for r in requests] == seeds.tolist()
    assert "sampling_seed" not in build_requests([[5]], np.full(1, 2), SamplingSettings())[0]["sampling_params"]
