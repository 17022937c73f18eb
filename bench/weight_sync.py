"""Weight sync to the engines: SGLang's distributed protocol (bucketed broadcast) vs the whole state dict through
Ray's object store, side by side in one run (issue 13).

A ~200M-parameter Qwen2 is built from config (no download) twice with different seeds: the engines (torch
backend, Ray actors, real router) start from one, the learner (a LearnerActor, frozen: no optimizer state) holds
the other, so every sync changes every tensor. Each path syncs `--reps` times after a warm-up (the warm-up forms
the weight-update group); `sync_s` is the median. `peak_extra_bytes` is the largest rise of peak resident memory
(VmHWM, reset before each sync) over the learner and engine processes; the object-store path's plasma copy is
counted where it is touched. `bit_identical`: sha256 of every tensor on every engine equals the learner's, after
the distributed sync.

Prints one JSON line on stdout; logs on stderr.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


log = logging.getLogger("bench.weight_sync")


def build_model(folder: Path, seed: int, args) -> int:
    """An HF Qwen2 folder (random weights, float32) -> parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def processes(manager, policy) -> list:
    return [policy.actors[0], *(h.actors[0] for h in manager.engines)]


def measure(manager, policy, sync) -> tuple[float, int]:
    """(seconds, peak extra bytes over the learner and engine processes) of one sync(); each process's peak is read
    inside it (Ray's __ray_call__)."""
    import ray

    from .process_memory import peak_rss_bytes, reset_peak_rss

    procs = processes(manager, policy)
    base = ray.get([p.__ray_call__.remote(lambda _actor: reset_peak_rss()) for p in procs])
    tic = time.perf_counter()
    sync()
    seconds = time.perf_counter() - tic
    peaks = ray.get([p.__ray_call__.remote(lambda _actor: peak_rss_bytes()) for p in procs])
    return seconds, max(peak - b for peak, b in zip(peaks, base))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=512.0, help="engines.weight_bucket_bytes in MiB")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    import ray

    from ..infra.cluster import init_ray, set_loopback_env
    from ..infra.config.engines import EnginesConfig
    from ..infra.config.run_config import build_config
    from ..rollout.fleet.manager import RolloutManager
    from ..rollout.fleet.weights.weight_update import WeightUpdate
    from ..tasks.learner.group import create_learner_group
    from .weight_digests import engine_weight_digests, learner_group_weight_digests

    set_loopback_env()
    bucket_bytes = int(args.bucket_mb * 2**20)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        engine_dir, learner_dir = Path(tmp) / "engine_model", Path(tmp) / "learner_model"
        params = build_model(engine_dir, 1, args)
        build_model(learner_dir, 2, args)
        log.info("models: %d parameters, %.0f MiB each", params, params * 4 / 2**20)
        init_ray(num_cpus=8)
        cfg = build_config(overrides=["grpo.kl_coef=0"])
        engines_cfg = EnginesConfig(rollout_num_gpus=args.engines, max_running_requests=2, health_interval_s=0,
                                    weight_sync="distributed", weight_bucket_bytes=bucket_bytes)
        policy = create_learner_group(learner_dir, cfg, trainable=False)
        manager = RolloutManager(engines_cfg, engine_dir, use_gpu=False, max_model_len=64)
        try:
            distributed = lambda v: manager.update_weights(WeightUpdate("distributed", policy, v))  # noqa: E731
            object_store = lambda v: manager.update_weights(  # noqa: E731
                WeightUpdate("tensor", policy.state_dict_refs.remote(), v))  # as policy_update sends it
            runs: dict[str, list[tuple[float, int]]] = {"distributed": [], "object_store": []}
            version = 0
            for rep in range(args.reps + 1):  # rep 0: warm-up (the group forms on the first distributed sync)
                for name, sync in (("distributed", distributed), ("object_store", object_store)):
                    version += 1
                    result = measure(manager, policy, lambda: sync(version))
                    log.info("%s rep %d: %.2f s, peak extra %.0f MiB", name, rep, result[0], result[1] / 2**20)
                    if rep:
                        runs[name].append(result)
            version += 1
            distributed(version)
            want = learner_group_weight_digests(policy)
            got = ray.get([h.actors[0].__ray_call__.remote(engine_weight_digests) for h in manager.engines])
            identical = all(all(g.get(k) == d for k, d in want.items()) for g in got)
            reported = set(manager.weight_versions.values())
            last = manager.weights.distributed.last
        finally:
            manager.shutdown()
            policy.shutdown()
            ray.shutdown()
    new_s = statistics.median(r[0] for r in runs["distributed"])
    old_s = statistics.median(r[0] for r in runs["object_store"])
    new_peak = max(r[1] for r in runs["distributed"])
    old_peak = max(r[1] for r in runs["object_store"])
    print(json.dumps({
        "params": params, "model_bytes": params * 4, "engines": args.engines, "bucket_bytes": bucket_bytes,
        "buckets": last.get("buckets"), "reps": args.reps,
        "distributed": {"sync_s": round(new_s, 3), "peak_extra_bytes": new_peak},
        "object_store": {"sync_s": round(old_s, 3), "peak_extra_bytes": old_peak},
        "peak_ratio": round(new_peak / bucket_bytes, 3), "speed_ratio": round(old_s / new_s, 3),
        "bit_identical": identical, "versions_reported": sorted(reported, key=str) == [version],
        "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 1)}))


if __name__ == "__main__":
    main()
