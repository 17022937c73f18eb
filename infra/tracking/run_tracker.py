"""Where a run reports: <run_dir>/metrics.jsonl and summary.json, the terminal (summary line, progress bar),
wandb (infra/tracking/wandb_shared.py), Prefect artifacts (infra/tracking/prefect_artifacts.py) and the report plots."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..prefect import env as prefect_env

if TYPE_CHECKING:
    from ..config.run_config import TrackingConfig

log = logging.getLogger(__name__)


def append_metrics(run_dir: Path, metrics: dict) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(metrics, default=_jsonable) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of metrics.jsonl. A last line with no newline that does not parse is an append a crash cut short
    (kill -9 mid-write): it is left out; an unparsable line anywhere else raises, naming the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON metrics row ({err.msg}); remove or fix that line") from None
    return rows


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    """metrics.jsonl replaced by `rows` in one step (a crash leaves the old file or the new one)."""
    path = Path(run_dir) / "metrics.jsonl"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row, default=_jsonable) + "\n" for row in rows), encoding="utf-8")
    os.replace(partial, path)


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
    if not any("reward_mean" in r for r in rows):  # SFT: no reward to summarise
        return {"iterations": len(rows), "wall_time_s": float(sum(r.get("time_s", 0.0) for r in rows)),
                "last_nll": rows[-1].get("nll")}
    rewards = np.array([r.get("reward_mean", 0.0) for r in rows])
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
    """The terminal's line per iteration; an SFT batch shows its per-token NLL instead of reward and loss."""
    scores = (f"sft nll {m.get('nll', 0):.4f}" if "sft_samples" in m else
              f"reward {m.get('reward_mean', 0):.3f}  exact {m.get('exact_match', 0):.2f}")
    loss = "" if "sft_samples" in m else f"  loss {m.get('loss', 0):+.4f}"
    if "turns_mean" in m:  # multi-turn tools (rollout/drivers/tool_turns.py)
        scores += f"  turns {m['turns_mean']:.2f}  tools {m.get('tool_calls', 0)} ({m.get('tool_errors', 0)} err)"
    return (f"iter {m['iteration']:>4}  {scores}  "
            f"len p50/max {m.get('response_length_p50', 0):.0f}/{m.get('response_length_max', 0)}  "
            f"partial {m.get('partial_rows', 0):>3}  stale {m.get('stale_token_share', 0):.2f}{loss}  "
            f"{m.get('time_s', 0):.1f}s")


def length_histogram(lengths, ages, max_tokens: int, round_tokens: int, max_bins: int = 64) -> dict:
    """Response lengths of the trained samples, counted per age (iterations carried over before training).

    lengths[S], ages[S] -> {"bin_width", "max_tokens", "round_tokens", "by_age": {age: counts[B]}};
    bin b holds lengths in [b * bin_width, (b + 1) * bin_width).
    """
    width = max(1, math.ceil((max_tokens + 1) / max_bins))
    bins = max_tokens // width + 1
    lengths, ages = np.asarray(lengths, dtype=np.int64), np.asarray(ages, dtype=np.int64)
    by_age = {str(a): np.bincount(np.minimum(lengths[ages == a] // width, bins - 1), minlength=bins).tolist()
              for a in np.unique(ages).tolist()}
    return {"bin_width": width, "max_tokens": int(max_tokens), "round_tokens": int(round_tokens), "by_age": by_age}


def summary_markdown(m: dict) -> str:
    """A short markdown summary of one iteration for the Prefect UI."""
    tasks = ", ".join(f"{name} {sec:.2f}s" for name, sec in sorted((m.get("task_s") or {}).items(),
                                                                   key=lambda kv: -kv[1]))
    ages = ", ".join(f"age {a}: {n}" for a, n in sorted((m.get("age_histogram") or {}).items())) or "none"
    return "\n".join([
        f"### Iteration {m.get('iteration')}",
        "",
        "| reward mean | exact match | length p50 / p90 / max | truncated | partial rows carried | loss | KL | IS weight |",
        "|---|---|---|---|---|---|---|---|",
        f"| {m.get('reward_mean', 0):.3f} | {m.get('exact_match', 0):.2f} | "
        f"{m.get('response_length_p50', 0):.0f} / {m.get('response_length_p90', 0):.0f} / "
        f"{m.get('response_length_max', 0)} | {m.get('truncated_share', 0):.2f} | {m.get('partial_rows', 0)} | "
        f"{m.get('loss', 0):+.4f} | {m.get('kl', 0):.4f} | {m.get('tis_weight_mean', 1.0):.3f} |",
        "",
        f"Rows in the dock after clear: {ages}. Generation: {m.get('rounds', 0)} rounds, "
        f"{m.get('tokens_generated', 0)} tokens. Iteration time {m.get('time_s', 0):.2f}s: {tasks}.",
        *([] if "token_staleness_max" not in m else [
            "", f"Off-policy: token staleness max {m['token_staleness_max']}, version span max "
            f"{m.get('version_span_max', 0)}, IS weight p50 / p99 / max {m.get('is_weight_p50', 1.0):.3f} / "
            f"{m.get('is_weight_p99', 1.0):.3f} / {m.get('is_weight_max', 1.0):.3f}, masked tokens "
            f"{m.get('masked_token_share', 0.0):.3f}, rejected samples {m.get('rejected_sequence_share', 0.0):.3f}, "
            f"training-inference KL {m.get('logprob_mismatch_kl', 0.0):.2e}."]),
    ])


def wandb_is_weight_histogram(hist: dict) -> dict:
    """The learner's IS-weight histogram ({"edges", "counts"}: tasks/learner/offpolicy_metrics.py) as a wandb.Histogram
    over log2(weight), where its bins are even -> {"train/is_weight_log2_hist": wandb.Histogram}."""
    import wandb

    counts, edges = np.asarray(hist["counts"]), np.log2(np.asarray(hist["edges"], dtype=np.float64))
    return {"train/is_weight_log2_hist": wandb.Histogram(np_histogram=(counts, edges))}


class RunTracker:
    """Where a run reports. The flow calls start(), on_round(progress) during generation,
    on_iteration(metrics, samples) after each iteration, finish(baseline) at the end and close() always.

    run_config: the RunConfig (wandb config, report cut lines); resume_wandb_id: continue that wandb run
    (store `wandb_run_id` in the checkpoint). Prefect artifacts are sent only inside a flow run.
    """

    def __init__(self, run_dir: Path, tracking_cfg: TrackingConfig, echo=None, *, run_config=None,
                 resume_wandb_id: str | None = None, progress_stream=None):
        from .prefect_artifacts import RunArtifacts
        from .terminal_progress import TerminalProgress

        # print looked up at call time: Prefect's log_prints swaps builtins.print inside a flow run
        echo = echo or (lambda text: print(text))
        self.run_dir, self.cfg, self.echo = Path(run_dir), tracking_cfg, echo
        self.run_config, self.resume_wandb_id = run_config, resume_wandb_id
        self.wandb_run = None
        name = tracking_cfg.run_name or self.run_dir.name
        self.artifacts = RunArtifacts(f"spillover-{name}")
        self._settle_reports = True  # start() decides from the Prefect server it reports to
        self.terminal = TerminalProgress(tracking_cfg.progress, echo, progress_stream)
        self.next_iteration = 0
        self.partial_rows_in = 0
        self.finished = False

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def start(self, resumed: bool = False, first_iteration: int = 0) -> None:
        from . import wandb_shared

        if not resumed:
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.next_iteration = first_iteration
        self.artifacts.start()
        self._settle_reports = not prefect_env.writes_never_collide()
        mode = self.cfg.wandb_mode
        config = self.run_config.model_dump(mode="json") if self.run_config is not None else None
        self.wandb_run = wandb_shared.start_driver_run(
            self.run_dir, mode, self.cfg.project, self.cfg.run_name,
            config, self.resume_wandb_id)

    def on_round(self, progress: dict) -> None:
        """progress: round, ready_groups, target_groups, tokens, elapsed_s (optionally partial_rows)."""
        self.terminal.update(self.next_iteration, progress, self.partial_rows_in)
        self.artifacts.on_round(self.next_iteration, progress)

    def on_iteration(self, row: dict, scalars: dict, response_lengths=None, ages=None, flow_run_id=None) -> None:
        """Record one finished iteration: row goes to metrics.jsonl, scalars (already under train/, rollout/,
        eval/, time/: tasks/results.py) to wandb. response_lengths / ages of the trained samples add the
        length histogram used by the report."""
        from . import wandb_shared

        if response_lengths is not None and self.run_config is not None:
            rollout = self.run_config.rollout
            row["response_length_hist"] = length_histogram(response_lengths, ages, rollout.max_tokens,
                                                           rollout.max_tokens // rollout.max_split)
        iteration = int(row["iteration"])
        if self.wandb_run is not None and (row.get("is_weight_hist") or {}).get("counts"):
            scalars = {**scalars, **wandb_is_weight_histogram(row["is_weight_hist"])}
        append_metrics(self.run_dir, row)
        self.terminal.line(one_line(row))
        wandb_shared.log_at_iteration(self.wandb_run, scalars, iteration)
        self.artifacts.on_iteration(iteration, row, summary_markdown(row), flow_run_id)
        self.next_iteration = iteration + 1
        self.partial_rows_in = int(row.get("partial_rows", 0))

    def finish(self, baseline: float | None, loop_wall_s: float | None = None, report=None) -> dict:
        """loop_wall_s: wall time of this process's iteration loop (Prefect, reporting and all); report:
        (run_dir, summary) -> (plot paths, markdown), attached to wandb and Prefect (spillover.infra.tracking.report.build_report)."""
        summary = summarize(read_metrics(self.run_dir), baseline)
        if loop_wall_s is not None:
            summary["loop_wall_s"] = loop_wall_s
        write_summary(self.run_dir, summary)
        if report is not None:
            self._attach_report(summary, report)
        self.finished = True
        return summary

    def _attach_report(self, summary: dict, report) -> None:
        from . import wandb_shared

        try:
            plots, markdown = report(self.run_dir, summary)
        except Exception as err:  # a plot must never fail a finished run
            log.warning("report not written: %s: %s", type(err).__name__, err)
            return
        wandb_shared.log_images(self.wandb_run, {p.stem: p for p in plots}, max(0, self.next_iteration - 1))
        self.artifacts.markdown("report", markdown, "run report")

    def settle(self) -> None:
        """Block until this iteration's reports have reached the Prefect server (see ArtifactSink.drain), unless
        that server queues its writes (the ephemeral in-memory database: spillover.infra.prefect.env)."""
        if self._settle_reports:
            self.artifacts.drain()

    def close(self) -> None:
        from . import wandb_shared

        self.terminal.close()
        self.artifacts.close()
        wandb_shared.finish(self.wandb_run, exit_code=0 if self.finished else 1)
        self.wandb_run = None
