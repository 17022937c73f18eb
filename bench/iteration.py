"""Iteration cost on the tiny config: time per task, the share of wall time that is Prefect + Ray
overhead, and rollout time with max_split=1 vs max_split=4, measured side by side in one process.

    python bench/iteration.py [--iterations 8] [--warmup 2] [key=value ...]

One JSON line on stdout: task_s (mean seconds per task per iteration) and overhead_share of the tiny config
as it is (its own max_split), rollout_time_ratio (generate time with max_split=1 / with max_split=4, the
same iterations otherwise), and per-run details.

Compute = time inside the engines' HTTP generation + the learner's own update time + logprob passes.
Overhead = everything else in the wall time of the iterations (Prefect subflows and tasks, Ray calls,
dock bookkeeping, reward bookkeeping, weight transfer to the engines).
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path


from ..infra.prefect.env import apply_process_defaults  # noqa: E402

COMPUTE_KEYS = ("engine_s", "update_s", "old_logprob_s", "ref_logprob_s")


def overhead_parts(rows: list[dict], loop_wall: float, compute: float) -> dict:
    """Mean seconds per iteration of the overhead's parts: the subflow's own cost (its wall time minus its
    tasks'), the tasks' time outside compute, the loop's reporting between subflows; and how many subflows
    paid Prefect's ~2 s client retry (SQLite refused a write: "database is locked")."""
    n = len(rows)
    subflow = [r["iteration_wall_s"] - r["time_s"] for r in rows]
    in_tasks = sum(r["time_s"] for r in rows) - compute
    return {"subflow": sum(subflow) / n, "in_tasks": in_tasks / n,
            "between_iterations": (loop_wall - sum(r["iteration_wall_s"] for r in rows)) / n,
            "subflows_over_1s": sum(s > 1.0 for s in subflow)}


def run_one(max_split: int | None, iterations: int, warmup: int, root: Path, overrides: list[str]) -> dict:
    from ..flows.train import grpo_train
    from ..infra.config.run_config import load_config
    from ..infra.tracking.run_tracker import read_metrics

    run_dir = root / f"split{max_split or 'config'}"
    split = [f"rollout.max_split={max_split}"] if max_split else []
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", *split,
                                            f"schedule.num_iterations={iterations + warmup}",
                                            "tracking.wandb_mode=disabled", "tracking.progress=false", *overrides])
    start = time.perf_counter()
    summary = grpo_train(cfg)
    total = time.perf_counter() - start
    every = read_metrics(run_dir)
    # overhead over the whole iteration loop (subflows, tasks, reporting, Ray calls, dock bookkeeping)
    wall = summary["loop_wall_s"]
    compute = sum(r.get(k, 0.0) for r in every for k in COMPUTE_KEYS)
    rows = every[warmup:]
    tasks = {name: sum(r["task_s"][name] for r in rows) / len(rows) for name in rows[0]["task_s"]}
    return {"max_split": cfg.rollout.max_split, "iterations": len(every), "iteration_s": wall / len(every),
            "generate_s": sum(r["generate_time_s"] for r in rows) / len(rows),
            "compute_s": compute / len(every), "overhead_share": max(0.0, wall - compute) / wall,
            "overhead_s": overhead_parts(every, wall, compute),
            "task_s": tasks, "run_total_s": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=8, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of the per-task means")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) on top of configs/tiny.yaml")
    args = parser.parse_args()
    apply_process_defaults()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        from prefect import flow

        @flow(name="bench-iteration")
        def runs() -> tuple[dict, dict, dict]:
            return tuple(run_one(split, args.iterations, args.warmup, Path(tmp), args.overrides)
                         for split in (None, 4, 1))

        import contextlib

        with contextlib.redirect_stdout(sys.stderr):
            tiny, split4, split1 = runs()
    print(json.dumps({"task_s": tiny["task_s"], "overhead_share": tiny["overhead_share"],
                      "rollout_time_ratio": split1["generate_s"] / split4["generate_s"],
                      "iteration_s": tiny["iteration_s"], "tiny": tiny, "split4": split4, "split1": split1}))


if __name__ == "__main__":
    main()
