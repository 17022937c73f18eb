"""Iteration cost on the tiny config: time per task, the share of wall time that is Prefect + Ray
overhead, and rollout time with max_split=1 vs max_split=4, measured side by side in one process.

    python bench/iteration.py [--iterations 8] [--warmup 2] [key=value ...]

One JSON line on stdout: task_s (mean seconds per task per iteration, max_split=4 run), overhead_share,
rollout_time_ratio (generate time with max_split=1 / with max_split=4), and per-run details.

Compute = time inside the engines' HTTP generation + the learner's own update time + logprob passes.
Overhead = everything else in the wall time of the iterations (Prefect subflows and tasks, Ray calls,
dock bookkeeping, reward bookkeeping, weight transfer to the engines).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.prefect_env import apply_process_defaults  # noqa: E402

COMPUTE_KEYS = ("engine_s", "update_s", "old_logprob_s", "ref_logprob_s")


def run_one(max_split: int, iterations: int, warmup: int, root: Path, overrides: list[str]) -> dict:
    from flows.train import grpo_train
    from infra.config import load_config
    from infra.tracking import read_metrics

    run_dir = root / f"split{max_split}"
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", f"rollout.max_split={max_split}",
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
    return {"max_split": max_split, "iterations": len(every), "iteration_s": wall / len(every),
            "generate_s": sum(r["generate_time_s"] for r in rows) / len(rows),
            "compute_s": compute / len(every), "overhead_share": max(0.0, wall - compute) / wall,
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
        def both() -> tuple[dict, dict]:
            return (run_one(4, args.iterations, args.warmup, Path(tmp), args.overrides),
                    run_one(1, args.iterations, args.warmup, Path(tmp), args.overrides))

        import contextlib

        with contextlib.redirect_stdout(sys.stderr):
            split4, split1 = both()
    print(json.dumps({"task_s": split4["task_s"], "overhead_share": split4["overhead_share"],
                      "rollout_time_ratio": split1["generate_s"] / split4["generate_s"],
                      "iteration_s": split4["iteration_s"], "split4": split4, "split1": split1}))


if __name__ == "__main__":
    main()
