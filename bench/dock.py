"""Benchmark the transfer dock through whole sync partial-rollout iterations, as the trainer drives it.

Per iteration: load (2 x GBS the first time, GBS after), rounds of max_tokens // max_split tokens from a
fake engine (response lengths lognormal, capped at max_tokens) until GBS groups are ready, select the
batch, build the learner's columnar batch from it once (`RolloutBatch.from_dock_arrays`, what the flow's
generate step hands on), clear. `bookkeeping_ms` is the wall time of
every dock call per iteration (not the fake generation, not the data set), averaged over iterations
after the first (which loads 2 x GBS and first-touches memory; `first_iteration_ms`);
`bookkeeping_cpu_ms` is the same in process CPU time (steadier on a shared machine). The Python-list views -- every
engine input as list[int], the batch as Sample objects -- are timed once and reported apart
(`list_views_not_in_bookkeeping`): they cost per token, and only a consumer that needs them pays.

    python bench/dock.py --gbs 1024 --n 8 --max-split 4     # one JSON line
    python bench/dock.py                                      # GBS {64,256,1024} x n {8,16}, max_split 4

Each configuration runs in its own process so that peak_rss_mb is its own. JSON on stdout, logs on stderr.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

from ..rollout.batch import to_samples
from ..rollout.dock.transfer_dock import TransferDock  # noqa: E402

EOS = 2
VOCAB = 32000


class FakeEngine:
    """Each sample (group_id*n + i) has a target length; a request generates up to max_new_tokens of it."""

    def __init__(self, rng: np.random.Generator, n: int, max_tokens: int, median: float, sigma: float):
        self.rng, self.n, self.max_tokens, self.median, self.sigma = rng, n, max_tokens, median, sigma
        self.target = np.zeros(0, dtype=np.int64)
        self.ends_with_eos = np.zeros(0, dtype=bool)

    def add_groups(self, count: int) -> None:
        raw = np.ceil(self.rng.lognormal(np.log(self.median), self.sigma, count * self.n)).astype(np.int64)
        self.target = np.concatenate([self.target, np.clip(raw, 1, self.max_tokens)])
        self.ends_with_eos = np.concatenate([self.ends_with_eos, raw <= self.max_tokens])

    def generate(self, sample_index: np.ndarray, done: np.ndarray, max_new: np.ndarray):
        """-> (flat tokens, lengths, flat logprobs, finished_by_stop) for one round."""
        remaining = self.target[sample_index] - done
        lengths = np.minimum(max_new, remaining)
        finishes = (lengths == remaining) & self.ends_with_eos[sample_index]
        flat = self.rng.integers(3, VOCAB, int(lengths.sum()), dtype=np.int64)
        ends = np.cumsum(lengths)
        flat[ends[finishes & (lengths > 0)] - 1] = EOS
        logprobs = -self.rng.random(len(flat), dtype=np.float32)
        return flat, lengths, logprobs, np.zeros(len(lengths), dtype=bool)


def run(gbs: int, n: int, max_split: int, max_tokens: int, iterations: int, median: float, sigma: float,
        seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt_len_range = (32, 512)
    dock = TransferDock(gbs, n, max_split, max_tokens, max_tokens + prompt_len_range[1] + 1, [EOS])
    engine = FakeEngine(rng, n, max_tokens, median, sigma)
    slot_group = np.full(dock.capacity_groups, -1, dtype=np.int64)
    next_group, version = 0, 0
    timings: dict[str, list[float]] = defaultdict(list)
    totals, cpu_totals, rounds, gen_tokens, snapshot_ms = [], [], [], [], []
    list_views: dict[str, float] = {}

    def timed(name, fn, *args):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        spent[name] += time.perf_counter() - t0
        cpu[0] += time.process_time() - c0
        return out

    for it in range(iterations):
        spent: dict[str, float] = defaultdict(float)
        cpu = [0.0]
        k = dock.free_group_slots()  # 2 x GBS, then the GBS trained
        ids = np.arange(next_group, next_group + k)
        lengths = rng.integers(*prompt_len_range, k)
        prompts = [rng.integers(3, VOCAB, m).tolist() for m in lengths.tolist()]  # the data set: not timed
        engine.add_groups(k)
        next_group += k
        slots = timed("load_groups", dock.load_groups, ids, prompts, [f"label-{i}" for i in ids.tolist()])
        slot_group[slots] = ids
        n_rounds = n_tokens = 0
        while not timed("update_ready", dock.update_ready):
            rows = timed("take_rows", dock.take_rows)
            inputs, max_new = timed("generation_inputs", dock.generation_inputs, rows, dock.max_tokens // dock.max_split)
            group = slot_group[rows // n]
            flat, lens, logprobs, stop = engine.generate(group * n + rows % n, inputs.response_lengths, max_new)
            timed("put_generation", dock.put_generation, rows, (flat, lens), (logprobs, lens), version, stop)
            n_rounds += 1
            n_tokens += len(flat)
        timed("select_batch", dock.select_batch)
        timed("rollout_batch", dock.rollout_batch)  # the one batch every later step reads
        timed("batch_group_ids", dock.batch_group_ids)  # clear/age-sort reports what was trained
        if it == iterations - 1:
            peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            list_views = _list_views(dock)
        timed("clear", dock.clear)
        timed("stats", dock.stats)
        version += 1
        t0 = time.perf_counter()
        dock.snapshot()
        snapshot_ms.append(1000 * (time.perf_counter() - t0))
        for name, sec in spent.items():
            timings[name].append(1000 * sec)
        totals.append(1000 * sum(spent.values()))
        cpu_totals.append(1000 * cpu[0])
        rounds.append(n_rounds)
        gen_tokens.append(n_tokens)
        print(f"[dock bench] gbs={gbs} n={n} it={it} rounds={n_rounds} tokens={n_tokens} "
              f"bookkeeping={totals[-1]:.1f} ms {dock.stats()['age_histogram']}", file=sys.stderr)
    steady = slice(1, None) if iterations > 1 else slice(None)  # iteration 0 loads 2 x GBS: reported apart
    return {
        "gbs": gbs, "n": n, "max_split": max_split, "max_tokens": max_tokens, "iterations": iterations,
        "bookkeeping_ms": round(float(np.mean(totals[steady])), 1),
        "bookkeeping_cpu_ms": round(float(np.mean(cpu_totals[steady])), 1),
        "bookkeeping_ms_max": round(float(np.max(totals[steady])), 1),
        "first_iteration_ms": round(totals[0], 1),
        "bookkeeping_ms_by_call": {k: round(float(np.mean(v[steady])), 1) for k, v in sorted(timings.items())},
        "snapshot_ms": round(float(np.mean(snapshot_ms)), 1),
        "list_views_not_in_bookkeeping": list_views,
        "rounds_per_iteration": round(float(np.mean(rounds)), 2),
        "generated_tokens_per_iteration": int(np.mean(gen_tokens)),
        "tokens_stored_end": dock.stats()["tokens_stored"],
        "peak_rss_mb": round(peak_rss_mb, 1),
    }


def _list_views(dock: TransferDock) -> dict[str, float]:
    """Time the Python-list views of the batch (after peak_rss_mb is read: Python objects are big)."""
    rows = (dock.select_batch()[:, None] * dock.n + np.arange(dock.n)).reshape(-1)
    t0 = time.perf_counter()
    dock.generation_inputs(rows, None)[0].to_lists()
    t1 = time.perf_counter()
    to_samples(dock.rollout_batch())
    t2 = time.perf_counter()
    return {"batch_inputs_to_lists_ms": round(1000 * (t1 - t0), 1), "batch_samples_ms": round(1000 * (t2 - t1), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gbs", type=int, help="global batch size (prompt groups per iteration)")
    parser.add_argument("--n", type=int, help="responses per prompt")
    parser.add_argument("--max-split", type=int, help="rounds per response (partial rollout when > 1)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="response length cap")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per configuration")
    parser.add_argument("--length-median", type=float, default=512, help="median of the lognormal response length")
    parser.add_argument("--length-sigma", type=float, default=1.0, help="sigma of the lognormal response length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    common = ["--max-tokens", str(args.max_tokens), "--iterations", str(args.iterations), "--length-median",
              str(args.length_median), "--length-sigma", str(args.length_sigma), "--seed", str(args.seed)]
    if args.gbs is None and args.n is None and args.max_split is None:
        for gbs in (64, 256, 1024):
            for n in (8, 16):
                cmd = [sys.executable, __file__, "--gbs", str(gbs), "--n", str(n), "--max-split", "4", *common]
                out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
                sys.stdout.write(out)
                sys.stdout.flush()
        return
    result = run(args.gbs or 1024, args.n or 8, args.max_split or 4, args.max_tokens, args.iterations,
                 args.length_median, args.length_sigma, args.seed)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
