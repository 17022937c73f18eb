"""Torch engine throughput through the real sglang-router vs HF `generate` in static batches.

Workload (same on both sides, fixed seed): 8 x concurrency requests, short prompts (4-16 tokens), long-tailed
lengths (lognormal max_new_tokens, ignore_eos, greedy). The engine gets them through the router with at most
`concurrency` in flight; HF `generate` runs them in static batches of `concurrency` (each batch runs until its
longest request ends). Only completion tokens count. One JSON line per concurrency on stdout; logs on stderr.

    python bench/engine.py --concurrency 64      # one line
    python bench/engine.py                       # 64 and 256
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from ..rollout.fleet.engine_client import EngineClient  # noqa: E402
from ..rollout.fleet.router import Router, free_port, stop_process  # noqa: E402
from ..rollout.sglang.protocol import GenerateRequest, SamplingParams  # noqa: E402


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def make_workload(n: int, vocab: int, seed: int, median: float, sigma: float, max_tokens: int):
    """n (prompt ids, max_new_tokens) pairs: prompts of 4-16 tokens, lognormal lengths in [1, max_tokens]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), 1, max_tokens).astype(int)
    prompts = [rng.integers(2, vocab, int(rng.integers(4, 17))).tolist() for _ in range(n)]
    return list(zip(prompts, lengths.tolist()))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a live process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_engine(model_dir: Path, port: int, max_running: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spillover.rollout.torch_engine.server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--max-running-requests", str(max_running), "--torch-threads", str(threads)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr, stdin=subprocess.DEVNULL,
                            cwd=Path(__file__).resolve().parents[1])


async def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    async with EngineClient(url) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await client.health():
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"engine {url} not healthy within {timeout_s} s")


async def run_engine(url: str, workload, concurrency: int) -> tuple[int, float]:
    """(completion tokens, seconds) for the workload with at most `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient(url, max_connections=concurrency + 8) as client:
        async def one(prompt, n):
            async with gate:
                params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
                res = await client.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                            return_logprob=True))
                return res.meta_info.completion_tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*[one(p, n) for p, n in workload])
        return sum(counts), time.perf_counter() - start


async def router_overhead_p50_ms(engine_url: str, router_url: str, n: int = 60) -> float:
    """p50 over n pairs of (routed - direct) latency of a 1-token request, the pair run back to back so
    both see the same machine load."""
    params = SamplingParams(max_new_tokens=1, temperature=0)
    async with EngineClient(engine_url) as direct, EngineClient(router_url) as routed:
        diffs = []
        for _ in range(n):
            t0 = time.perf_counter()
            await direct.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=params))
            t1 = time.perf_counter()
            await routed.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=params))
            diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return float(np.median(diffs)) * 1e3


def run_hf(model_dir: Path, workload, batch_size: int) -> tuple[int, float]:
    """(completion tokens, seconds) of HF generate over the workload in static batches (left padded)."""
    import torch

    from .reference_lm import load_causal_lm

    model = load_causal_lm(model_dir).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like the engine side
    tokens, elapsed = 0, 0.0
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(n for _, n in batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=0)
        elapsed += time.perf_counter() - t0
        assert out.shape[1] - width == longest
        tokens += sum(n for _, n in batch)  # the useful tokens; the rest of each row is waste
    return tokens, elapsed


def bench(concurrency: int, args, model_dir: Path) -> dict:
    workload = make_workload(8 * concurrency, args.vocab, args.seed, args.median_tokens, args.sigma, args.max_tokens)
    port = free_port()
    engine = start_engine(model_dir, port, max(concurrency, args.max_running_requests or 0), args.engine_threads)
    router = None
    try:
        engine_url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(engine_url))
        router = Router.launch(host="127.0.0.1", worker_urls=[engine_url])
        asyncio.run(run_engine(router.url, workload[:concurrency], concurrency))  # warm-up
        cpu0 = process_cpu_s(engine.pid) + process_cpu_s(router.pid) + time.process_time()
        engine_tokens, engine_s = asyncio.run(run_engine(router.url, workload, concurrency))
        engine_cpu = process_cpu_s(engine.pid) + process_cpu_s(router.pid) + time.process_time() - cpu0
        overhead_ms = asyncio.run(router_overhead_p50_ms(engine_url, router.url))
    finally:
        if router is not None:
            router.stop()
        stop_process(engine)
    import torch

    torch.set_num_threads(args.hf_threads)
    run_hf(model_dir, workload[:concurrency], concurrency)  # warm-up
    cpu0 = time.process_time()
    hf_tokens, hf_s = run_hf(model_dir, workload, concurrency)
    hf_cpu = time.process_time() - cpu0
    assert hf_tokens == engine_tokens, (hf_tokens, engine_tokens)
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    log(f"concurrency {concurrency}: engine {engine_tokens} tok in {engine_s:.2f}s, hf {hf_tokens} tok in {hf_s:.2f}s")
    return {"concurrency": concurrency, "requests": len(workload), "completion_tokens": engine_tokens,
            "engine_tokens_per_s": round(engine_tps, 1), "hf_generate_tokens_per_s": round(hf_tps, 1),
            "ratio": round(engine_tps / hf_tps, 3), "router_overhead_ms_p50": round(overhead_ms, 3),
            "engine_s": round(engine_s, 3), "hf_s": round(hf_s, 3),
            "engine_cpu_s": round(engine_cpu, 3), "hf_cpu_s": round(hf_cpu, 3), "cpu_ratio": round(hf_cpu / engine_cpu, 3), "engine_threads": args.engine_threads,
            "hf_threads": args.hf_threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, action="append", help="in-flight requests (repeatable); default 64 and 256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--median-tokens", type=float, default=48.0, help="median of the lognormal max_new_tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="sigma of the lognormal max_new_tokens")
    p.add_argument("--max-tokens", type=int, default=480, help="cap on max_new_tokens (the model's context is 512)")
    p.add_argument("--max-running-requests", type=int, default=None, help="engine slots (default: concurrency)")
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine process")
    p.add_argument("--hf-threads", type=int, default=1, help="torch threads for HF generate (as the engine)")
    args = p.parse_args()
    from ..infra.config.run_config import TinyModelConfig
    from ..infra.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", TinyModelConfig())
        args.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        for concurrency in args.concurrency or [64, 256]:
            print(json.dumps(bench(concurrency, args, model_dir)), flush=True)


if __name__ == "__main__":
    main()
