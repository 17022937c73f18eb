"""Warm parts (tests/warm_parts.py): a run on engines and learners kept from an earlier run trains exactly as a run
on new ones -- the same samples, rewards, losses and final weights, optimizer state and RNG -- so the suite's
flow tests can share them (tests/fixtures_warm.py) without changing what they prove."""
import json

import torch

from test_train_flow import small_config
from warm_parts import WarmParts

# Tokens independent of the engines' history (every request carries a seed), old logprobs from the learner; a
# reference group of its own (KL, learner.reference_placement=separate) so that all three kinds of part are kept.
DETERMINISTIC = {"rollout.deterministic_sampling": "true", "grpo.kl_coef": "0.05", "grpo.skip_old_logprob": "false", "grpo.off_policy": "none",
                 "learner.reference_placement": "separate", "grpo.reward_function_path": "small_run.distinct_chars"}


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_tensors(run_dir):
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.storage.store import open_store

    return load_latest_checkpoint(open_store(str(run_dir / "checkpoints"))).tensors["policy"]


def test_kept_parts_train_exactly_like_new_ones_and_take_the_new_runs_settings(prefect_harness, ray_session,
                                                                                tmp_path):
    """(Which parts may serve which run: tests/unit/test_warm_parts_pool.py.)"""
    from spillover.flows.train import grpo_train

    first, second = tmp_path / "first", tmp_path / "second"
    distributed = {**DETERMINISTIC, "engines.weight_sync": "distributed"}
    with WarmParts() as pool:
        grpo_train(small_config(first, iterations=2, **distributed), parts=pool)
        assert pool.reused == 0  # a new pool starts every part
        grpo_train(small_config(second, iterations=2, **distributed), parts=pool)
        assert pool.reused == 3  # engines, policy and reference: kept, reset, reused
        summary = grpo_train(small_config(tmp_path / "disk", iterations=2, **{**DETERMINISTIC, "grpo.kl_coef": "0",
                                                                                 "engines.weight_sync": "disk"}),
                             parts=pool)
        assert pool.reused == 5  # engines and policy (no KL: no reference): the reset applies the weight-sync mode
        assert pool.started == 3
    got, want = rows(second), rows(first)
    assert len({r["loss"] for r in want}) > 1 and want[0]["grad_norm"] > 0  # the weights really move
    for key in ("trained_stream_ids", "reward_mean", "response_length_p50", "loss", "grad_norm", "kl",
                "weight_version"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    got_t, want_t = final_tensors(second), final_tensors(first)
    assert sorted(got_t) == sorted(want_t)
    assert [n for n in want_t if not torch.equal(got_t[n], want_t[n])] == []  # weights, AdamW state, RNG
    assert summary["iterations"] == 2 and [r["weight_version"] for r in rows(tmp_path / "disk")] == [1, 2]
    # disk sync, next to that run's model folder: the reset engines know the new run's model path; only the version
    # served is kept (a folder a version would fill the disk), and no half-written folder is left
    synced = tmp_path / "disk" / "synced_weights"
    assert sorted(p.name for p in synced.iterdir()) == ["version-2"] and (synced / "version-2" / "config.json").is_file()


def test_a_reset_restarts_each_engines_random_stream(ray_session, warm_parts, tmp_path):
    """Unseeded sampling (no rollout.deterministic_sampling) draws from each engine's generator: a reset restarts
    it from the engine's start seed, so what a run samples does not depend on what the engines served before.
    One request at a time on each engine, so an answer depends on the stream alone, not on batching or timing
    (a whole run does not: which rows share a decode step, and which are cut, depends on arrival order)."""
    from spillover.infra.models import resolve_model_path

    cfg = small_config(tmp_path / "run")  # the suite's flow tests' engines: borrowed when they are idle
    model = resolve_model_path(cfg.model, tmp_path / "run", max(512, cfg.rollout.max_model_len))
    from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest

    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}

    def sample(manager):
        return [manager.generate([GenerateJob(GenerateRequest(input_ids=[3, 4, 5, 6], sampling_params=params), i)])[0]
                .output_ids for i in range(manager.num_engines)]

    manager = warm_parts.fleet(cfg.engines, model)
    try:
        first, later = sample(manager), sample(manager)  # later: what the next run would get without a reset
    finally:
        warm_parts.give_back(manager)
    manager = warm_parts.fleet(cfg.engines, model)
    try:
        again = sample(manager)
    finally:
        warm_parts.give_back(manager)
    assert len(first) == 2 and later != first  # the stream moves on from request to request
    assert again == first
