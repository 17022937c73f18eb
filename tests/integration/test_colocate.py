"""Colocated engines (placement.colocate, issue 13): the torch engine lives in the policy learner rank's process and
the two take turns with its memory. Checked on real Ray actors and a real engine server:
- a hosted engine runs in the learner's process; releasing its memory frees its weights and KV cache for real
  (their bytes go to 0, and what comes back at resume is not the old weights), generation is refused meanwhile,
  and after resume + the colocated sync (bucket by bucket, a bucket smaller than the largest tensor) its weights
  equal the learner's bit for bit and it generates the same greedy tokens as before the release;
- a colocated run of the tiny task with two learner ranks (each hosting an engine, FSDP gathers collective) goes
  release -> logprobs -> update -> resume of the weights -> weight load -> resume of the KV cache in that order in
  every iteration (read from rank 0's process's own event log) and its reward rises (one rank colocated: the kill -9
  test's file chain);
- bench/gpu_smoke.py, the same cycle without Ray for the GPU machine, runs on CPU.
"""
from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import ray

from fleet_probes import on_hosted_engine, take_update_peak_bytes, take_weight_update_events
from spillover.bench.weight_digests import engine_weight_digests, learner_group_weight_digests
from spillover.infra.config.run_config import build_config
from spillover.rollout.fleet.weights.weight_update import WeightUpdate
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest
from small_run import SMALL_RUN
from test_train_flow import small_config

pytestmark = pytest.mark.timeout(300)
COLOCATED = ["placement.colocate=true", "engines.rollout_num_gpus=1"]


def greedy(manager, prompts: list[list[int]]) -> list[list[int]]:
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    batch = [GenerateJob(GenerateRequest(input_ids=p, sampling_params=params)) for p in prompts]
    return [answer.output_ids for answer in manager.generate(batch)]


def test_hosted_engine_releases_for_real_refuses_generation_and_comes_back_with_the_learners_weights(
        ray_session, tiny_model_dir):
    from spillover.rollout.fleet.manager import RolloutManager
    from spillover.tasks.learner.group import create_learner_group

    cfg = build_config(overrides=[*SMALL_RUN, *COLOCATED, "engines.weight_bucket_bytes=20000"])
    policy = create_learner_group(tiny_model_dir, cfg, trainable=True)
    manager = None
    try:
        manager = RolloutManager(cfg.engines, tiny_model_dir, hosts=policy.actors, use_gpu=False)
        host, engine = policy.actors[0], manager.engines[0]
        assert manager.colocated
        assert engine.pids == [ray.get(host.__ray_call__.remote(lambda _: os.getpid()))]  # the learner's process
        prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
        before = greedy(manager, prompts)
        held = ray.get(host.engine_call.remote("memory_bytes"))
        assert held["weights"] > 0 and held["kv_cache"] > 0

        manager.offload()
        assert ray.get(host.engine_call.remote("memory_bytes")) == {"weights": 0, "kv_cache": 0}
        refused = httpx.post(engine.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {}}, timeout=30)
        assert refused.status_code == 503 and "resume_memory_occupation" in refused.text

        learner = learner_group_weight_digests(policy)
        ray.get(host.__ray_call__.remote(on_hosted_engine, take_weight_update_events))
        manager.update_weights(WeightUpdate("colocated", policy, 1))  # resume, then the learner's tensors in buckets
        # over HTTP, in SGLang's session
        events = ray.get(host.__ray_call__.remote(on_hosted_engine, take_weight_update_events))
        assert events[0] == "begin_weight_update" and events[-1] == "end_weight_update", events
        assert set(events[1:-1]) == {"update_weights_from_tensor"} and len(events) > 4, events
        assert ray.get(host.engine_call.remote("memory_bytes")) == held
        assert ray.get(host.__ray_call__.remote(on_hosted_engine, engine_weight_digests)) == learner
        assert manager.weight_versions == {0: 1}
        assert greedy(manager, prompts) == before
        largest = max(4 * int(np.prod(shape)) for _, _, shape in ray.get(host.weight_specs.remote()))
        peak = ray.get(host.__ray_call__.remote(on_hosted_engine, take_update_peak_bytes))
        assert 0 < peak <= max(20000, largest)  # in place
        log = ray.get(host.take_colocation_log.remote())  # weights resumed, loaded, then the KV cache (issue 37)
        assert log[-4:] == ["release", "resume:weights", "load_weights", "resume:kv_cache,cuda_graph"], log
    finally:
        if manager is not None:
            manager.shutdown()
        policy.shutdown()


def test_colocated_run_releases_trains_resumes_and_syncs_in_order_every_iteration(prefect_harness, ray_session,
                                                                                  tmp_path):
    from spillover.flows.train import grpo_train

    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, iterations=6, **{"placement.colocate": "true", "engines.rollout_num_gpus": 2,
                                                  "learner.world_size": 2,
                                                  "grpo.reward_function_path": "small_run.distinct_ones",
                                                  "grpo.skip_old_logprob": "false", "optimizer.lr": 0.01,
                                                  "engines.weight_bucket_bytes": 20000,
                                                  "rollout.deterministic_sampling": "true"})  # the same run every time
    summary = grpo_train(cfg)
    assert summary["iterations"] == 6
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in metrics:
        assert row["colocation_events"] == ["release", "compute_logprobs", "update", "resume:weights", "load_weights",
                                            "resume:kv_cache,cuda_graph"], row
    rewards = [r["reward_mean"] for r in metrics]
    assert sum(rewards[-2:]) > sum(rewards[:2]), rewards


WITHOUT_RAY_OR_PREFECT = """
import json, sys
class Missing:  # the GPU machine has torch and transformers, but no Ray, Prefect, wandb, s3fs or sglang-router
    # (pydantic, fastapi, uvicorn and orjson travel there as wheels: make gpu-wheels)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "prefect", "wandb", "s3fs", "sglang_router"):
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, Missing())
from spillover.bench.gpu_smoke import main
main(sys.argv[1:])
"""


GPU_SMOKE_CPU_ARGS = ["--device", "cpu", "--batch", "4", "--max-new", "8", "--bucket-mb", "0.02", "--learner-samples",
                      "8", "--learner-tokens", "24"]


@pytest.mark.early("gpu_smoke_dry_run", cpu_s=10)  # a subprocess: it runs in the background
def test_gpu_smoke_dry_run_on_cpu(gpu_smoke_dry_run):
    """bench/gpu_smoke.py (the colocated engine, a tensor update, an in-flight update, the learner, max_split 1 vs 4;
    for the GPU machine) on CPU, in a process where Ray, Prefect and the other packages that machine lacks cannot be
    imported, so it cannot rot."""
    code, stdout, stderr = gpu_smoke_dry_run.result()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert code == 0 and lines, stderr[-3000:]
    out = json.loads(lines[-1])
    per_check = [c for c in map(json.loads, lines[:-1]) if "check" in c]  # a line as each check ends, then all
    assert [c["check"] for c in per_check] == list(out["check_s"]) and all(c["error"] is None for c in per_check)
    assert out["buckets"] > 1 and out["weights_equal"] == [True, True, True]
    assert out["released_to_zero"] and out["engine_held_mb"] > 0 and out["greedy_changed"]
    assert out["kv_cache_free_during_load"]  # weights resumed and loaded before the KV cache (issue 37)
    assert out["health"]["generation"]["paused"] == "no answer" and out["health"]["liveness"]["released"] == 200
    learner = out["learner"]  # issue 12's learner part: spillover's LearnerActor, three update steps
    assert learner["size"] == "tiny" and learner["params"] > 0 and len(learner["step_s"]) == 3
    assert learner["update_tokens_per_s"] > 0 and learner["mfu"] > 0
    assert learner["pack_sequences"] and learner["padding_share"] == 0.0  # the recipe's packed token budget (issue 36)
    update = out["tensor_update"]  # issue 28: the client path that drives SGLang, against the torch engine's HTTP server
    assert update["refused_outside_session"] and update["version"] == 1 and update["weights_equal"]
    assert update["buckets"] > 1 and update["events"] == ["begin_weight_update", "end_weight_update"]
    inflight = out["inflight_update"]  # issue 31: a request running through an in_place weight update
    assert [span["version"] for span in inflight["spans"]] == ["0", "1"] and inflight["tokens"] == inflight["asked"]
    assert inflight["kv_kept"] == 1 and inflight["flush_refused"] and inflight["steps_while_paused"] == 0
    cut = out["stop_across_cut"]  # issue 37: a stop string split by a cut ends the row where an uncut request ends
    assert cut["carried"] and cut["engine_continued"] > 1 and cut["row_equals_uncut"] and cut["row_stopped"]
    rollout = out["rollout"]  # max_split 1 vs 4 through the real dock and driver, engines in this process
    assert set(rollout) == {"no_partial", "sync_split4"} and all(r["rollout_s"] > 0 for r in rollout.values())
