"""Time the learner on the tiny model: compute_logprobs and one update (in-process, no Ray).

One JSON line per (micro_batch, threads) configuration on stdout; logs to stderr.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from ..infra.config.training import GRPOConfig, OptimizerConfig
from ..infra.models import build_tiny_model
from ..rollout.batch import RolloutBatch
from .batches import from_sequences
from ..tasks.learner.actor import LearnerActor


def random_batch(samples: int, tokens: int, seed: int) -> RolloutBatch:
    """`samples` sequences of ~`tokens` tokens (prompt 4-6, the rest response, +-25%)."""
    rng = np.random.default_rng(seed)
    toks, resp = [], []
    for _ in range(samples):
        prompt = int(rng.integers(4, 7))
        r = max(1, int(rng.integers(int(0.75 * (tokens - prompt)), int(1.25 * (tokens - prompt)) + 1)))
        toks.append(rng.integers(2, 40, prompt + r).tolist())
        resp.append(r)
    return from_sequences(toks, resp, [[-3.0] * r for r in resp], [[0] * r for r in resp],
                          advantages=rng.normal(size=samples))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="learner_step_"))
    batch = random_batch(args.samples, args.tokens, seed=0)
    for threads in args.threads:
        for mbs in args.micro_batch:
            learner = LearnerActor(str(model_dir), GRPOConfig(micro_batch_size=mbs), OptimizerConfig(), 1.0, 0, True,
                                   num_threads=threads)
            logprob_s, update_s = [], []
            for _ in range(args.repeats + 1):  # the first round warms up
                t0 = time.perf_counter()
                old = learner.compute_logprobs(batch)
                t1 = time.perf_counter()
                learner.update(batch, old, None)
                logprob_s.append(t1 - t0)
                update_s.append(time.perf_counter() - t1)
            print(json.dumps({
                "samples": args.samples, "tokens_per_sample_mean": float(np.mean([len(t) for t in batch.tokens])),
                "response_tokens": int(sum(batch.response_lengths)), "micro_batch": mbs, "threads": threads,
                "torch_threads": torch.get_num_threads(), "compute_logprobs_s": statistics.median(logprob_s[1:]),
                "update_s": statistics.median(update_s[1:]), "update_s_min": min(update_s[1:]),
            }))


if __name__ == "__main__":
    main()
