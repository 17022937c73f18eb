"""Per-iteration metrics: <run_dir>/metrics.jsonl, <run_dir>/summary.json, and a one-line terminal summary."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def append_metrics(run_dir: Path, metrics: dict) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(metrics, default=_jsonable) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able: {type(value).__name__}")


def summarize(rows: list[dict], baseline: float | None) -> dict:
    """Run summary: reward curve ends, last-fifth mean, and the prompt-independent baseline."""
    if not rows:
        return {"iterations": 0}
    rewards = np.array([r["reward_mean"] for r in rows])
    tail = rewards[-max(1, len(rewards) // 5):]
    out = {"iterations": len(rows), "first_reward_mean": float(rewards[0]), "best_reward_mean": float(rewards.max()),
           "last_fifth_reward_mean": float(tail.mean()), "reward_rise": float(tail.mean() - rewards[0]),
           "wall_time_s": float(sum(r.get("time_s", 0.0) for r in rows))}
    if baseline is not None:
        out["prompt_independent_baseline"] = float(baseline)
        out["margin_over_baseline"] = float(tail.mean() - baseline)
    if "exact_match" in rows[-1]:
        out["last_fifth_exact_match"] = float(np.mean([r.get("exact_match", 0.0) for r in rows[-len(tail):]]))
    return out


def write_summary(run_dir: Path, summary: dict) -> None:
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))


def one_line(m: dict) -> str:
    return (f"iter {m['iteration']:>4}  reward {m.get('reward_mean', 0):.3f}  exact {m.get('exact_match', 0):.2f}  "
            f"len p50/max {m.get('response_length_p50', 0):.0f}/{m.get('response_length_max', 0)}  "
            f"partial {m.get('partial_rows', 0):>3}  stale {m.get('stale_token_share', 0):.2f}  "
            f"loss {m.get('loss', 0):+.4f}  {m.get('time_s', 0):.1f}s")


class RunTracker:
    """Where a run reports: metrics.jsonl and the terminal now; wandb, Prefect artifacts and the
    progress bar hook in here. The flow calls on_round() during generation and on_iteration() after."""

    def __init__(self, run_dir: Path, tracking_cfg=None, echo=print):
        self.run_dir, self.cfg, self.echo = Path(run_dir), tracking_cfg, echo

    def start(self, resumed: bool = False) -> None:
        if not resumed:
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)

    def on_round(self, progress: dict) -> None:
        """progress: round, ready_groups, target_groups, tokens, elapsed_s."""

    def on_iteration(self, metrics: dict) -> None:
        append_metrics(self.run_dir, metrics)
        self.echo(one_line(metrics))

    def finish(self, baseline: float | None) -> dict:
        summary = summarize(read_metrics(self.run_dir), baseline)
        write_summary(self.run_dir, summary)
        return summary

    def close(self) -> None:
        pass
