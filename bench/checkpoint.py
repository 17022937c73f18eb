"""Checkpoint write/load throughput next to plain fsspec put/get of the same bytes, on file:// and on a
local SeaweedFS S3 server (started here on 127.0.0.1), for the tiny model + AdamW state and for a synthetic
200M-parameter fp32 state (weights + two AdamW moments, ~2.4 GB).

    python bench/checkpoint.py [--states tiny,200m] [--storages file,s3] [--repeats 3]

One JSON line per (state, storage) on stdout: state, storage, bytes, objects (incl. meta and manifest), write_mb_s, load_mb_s,
plain_put_mb_s, plain_get_mb_s, write_ratio, load_ratio (ratios = checkpoint / plain; target >= 0.8).
Plain and checkpoint runs alternate in one process; each figure is the best of --repeats (the *_median
keys: the medians). sha256_mb_s is one thread's sha256 of the same bytes in this run: a checkpoint hashes
every byte it writes and loads, so where plain I/O runs faster than that (page-cache reads of a small
state) one core cannot reach plain speed.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import gc
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from fsspec.implementations.local import LocalFileSystem


from ..infra.storage.checkpoint import (MAX_OBJECT_BYTES, CheckpointState, plan_objects, checkpoint_name,  # noqa: E402
                                        load_checkpoint, save_checkpoint)
from ..infra.storage.checkpoint_objects import object_bytes  # noqa: E402
from ..infra.storage.store import open_store  # noqa: E402
from ..tasks.learner.state import save_state, unique_state_keys  # noqa: E402
from .seaweed_server import SeaweedS3  # noqa: E402

log = logging.getLogger("bench.checkpoint")


def tiny_state(work: Path) -> CheckpointState:
    from ..infra.models import build_tiny_model
    from .reference_lm import load_causal_lm

    model = load_causal_lm(build_tiny_model(work / "tiny_model"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    tensors, meta = save_state(model, model, opt, [], unique_state_keys(model), sharded=False, version=0, trainable=True)
    return CheckpointState(0, {"policy": tensors}, {}, {"learner": meta})  # the layout tasks/run_state.py writes


def synthetic_state(n_params: int, hidden: int = 1024, vocab: int = 32000) -> CheckpointState:
    """fp32 weights shaped like a small transformer (embedding + layers of attention/MLP matrices) with
    `n_params` parameters in all, and AdamW's exp_avg / exp_avg_sq of the same shapes."""
    shapes = {"embed.weight": (vocab, hidden)}
    per_layer = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden),
                 "up": (hidden * 11 // 4, hidden), "gate": (hidden * 11 // 4, hidden), "down": (hidden, hidden * 11 // 4)}
    layer, total = 0, vocab * hidden
    while total < n_params:
        for name, shape in per_layer.items():
            rows = min(shape[0], max(1, (n_params - total) // shape[1]))
            if total < n_params:
                shapes[f"layers.{layer}.{name}.weight"] = (rows, shape[1])
                total += rows * shape[1]
        layer += 1
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    opt = {}
    for i, (n, t) in enumerate(weights.items()):
        opt[f"{i}.exp_avg"] = t * 1e-3
        opt[f"{i}.exp_avg_sq"] = t * t * 1e-6
        opt[f"{i}.step"] = torch.tensor(10.0)
    return CheckpointState(0, {"policy": weights, "optimizer": opt}, {}, {"note": "synthetic"})


def plain_payloads(state: CheckpointState, max_object_bytes: int) -> dict[str, Callable[[], bytes]]:
    """key -> a function making the exact bytes of that checkpoint object (called outside the timed part,
    one object at a time, so the plain runs never hold a second copy of the whole state)."""
    objects, _ = plan_objects(state, max_object_bytes)
    out = {key: (lambda kind=kind, values=values: object_bytes(kind, values)) for key, (kind, values) in objects.items()}
    meta = json.dumps(state.meta).encode()
    out["meta.json"] = lambda: meta
    manifest = json.dumps({"objects": {k: {"size": len(make()), "sha256": "0" * 64}
                                       for k, make in out.items()}}, indent=1).encode()
    out["manifest.json"] = lambda: manifest
    return out


class Clock:
    """Accumulates wall seconds and process CPU seconds (all threads) of the timed blocks."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._t, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._t
        self.cpu += time.process_time() - self._c


def plain_put(fs, store, payloads) -> tuple[Clock, int]:
    """fs.pipe_file over all objects, one after another (each with s3fs's own parallel multipart upload:
    faster on weed than fs.pipe(dict)); the bytes are made outside the clock."""
    clock, total = Clock(), 0
    for key, make in payloads.items():
        data = make()
        with clock:
            fs.pipe_file(store.path(f"plain/{key}"), data)
        total += len(data)
        del data
    return clock, total


def plain_get(fs, store, name, keys) -> Clock:
    with Clock() as clock:
        for key in keys:
            data = fs.cat_file(store.path(f"{name}/{key}"))
            del data
    return clock


def sha256_seconds(payloads) -> float:
    total = 0.0
    for make in payloads.values():
        data = make()
        start = time.perf_counter()
        hashlib.sha256(data).digest()
        total += time.perf_counter() - start
    return total


def measure(store, state: CheckpointState, repeats: int) -> dict:
    fs = LocalFileSystem(auto_mkdir=True) if store.is_local else store.fs  # plain put makes its directories
    payloads = plain_payloads(state, MAX_OBJECT_BYTES)
    name = checkpoint_name(state.iteration)
    runs: dict[str, list[Clock]] = {"plain_put": [], "write": [], "plain_get": [], "load": []}
    for _ in range(repeats):  # plain and checkpoint alternate, so load on the machine hits both alike
        store.delete("plain")
        gc.collect()
        clock, total = plain_put(fs, store, payloads)
        runs["plain_put"].append(clock)
        store.delete(name)
        gc.collect()
        with Clock() as clock:
            save_checkpoint(store, state)
        runs["write"].append(clock)
        gc.collect()
        runs["plain_get"].append(plain_get(fs, store, name, payloads))
        gc.collect()
        with Clock() as clock:
            loaded = load_checkpoint(store, state.iteration)
        runs["load"].append(clock)
        del loaded
        gc.collect()
    store.delete("plain")
    store.delete(name)
    gc.collect()
    sha_s = min(sha256_seconds(payloads) for _ in range(min(repeats, 3)))
    mb = total / 1e6
    best = {k: min(c.wall for c in v) for k, v in runs.items()}
    med = {k: statistics.median(c.wall for c in v) for k, v in runs.items()}
    cpu = {k: min(c.cpu for c in v) for k, v in runs.items()}
    log.info("%s wall s: %s", store.url, {k: [round(c.wall, 3) for c in v] for k, v in runs.items()})
    out = {"bytes": total, "objects": len(payloads), "repeats": repeats,
           "write_mb_s": mb / best["write"], "load_mb_s": mb / best["load"],
           "plain_put_mb_s": mb / best["plain_put"], "plain_get_mb_s": mb / best["plain_get"],
           "sha256_mb_s": mb / sha_s,
           "write_ratio": best["plain_put"] / best["write"], "load_ratio": best["plain_get"] / best["load"],
           "write_ratio_median": med["plain_put"] / med["write"], "load_ratio_median": med["plain_get"] / med["load"],
           **{f"{k}_cpu_s": v for k, v in cpu.items()}}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--states", default="tiny,200m", help="comma list of: tiny, 200m")
    ap.add_argument("--storages", default="file,s3", help="comma list of: file, s3")
    ap.add_argument("--repeats", type=int, default=0, help="runs per figure (0: 15 for tiny, 2 for 200m on "
                    "file, 1 for 200m on s3)")
    ap.add_argument("--params", type=float, default=200e6, help="parameters of the synthetic '200m' state")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("spillover").setLevel(logging.WARNING)
    states = args.states.split(",")
    storages = args.storages.split(",")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-ckpt-") as work_dir:
        work = Path(work_dir)
        server = SeaweedS3(work / "seaweed", bucket="bench").start() if "s3" in storages else None
        try:
            for state_name in states:
                state = tiny_state(work) if state_name == "tiny" else synthetic_state(int(args.params))
                for storage in storages:
                    repeats = args.repeats or (15 if state_name == "tiny" else 2 if storage == "file" else 1)
                    store = (open_store(str(work / "file-store")) if storage == "file"
                             else open_store(server.url("store"), server.storage_config()))
                    log.info("measuring %s on %s (%d repeats)", state_name, storage, repeats)
                    result = {"state": state_name, "storage": storage, **measure(store, state, repeats)}
                    print(json.dumps(result), flush=True)
                del state
                gc.collect()
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
