"""`spillover report RUN_DIR`: PNG plots of a run from its metrics.jsonl, into RUN_DIR/report/.

reward.png     reward over iterations (mean +- std, exact match, the prompt-independent baseline)
lengths.png    response length distribution of trained samples by age (long tail, round cuts, max_tokens)
carryover.png  rows carried over after each iteration, by age, and how many of them are partial
task_time.png  time per task per iteration
is_weights.png IS weights exp(old - rollout) of the trained tokens per iteration (histogram and quantiles)
predictions.png the length history's predicted vs true mean length of each trained group, and predictor_r per iteration
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from .run_tracker import read_metrics

PLOTS = ("reward", "lengths", "carryover", "task_time", "is_weights", "predictions")
TASK_ORDER = ["load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob",
              "compute_old_logprob", "update", "clear_and_age_sort"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _column(rows: list[dict], key: str, default=np.nan) -> np.ndarray:
    return np.array([float(r.get(key, default)) for r in rows])


def plot_reward(rows: list[dict], summary: dict, path: Path) -> None:
    plt = _pyplot()
    its, mean, std = _column(rows, "iteration"), _column(rows, "reward_mean"), _column(rows, "reward_std", 0.0)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(its, mean, marker="o", ms=3, label="reward mean")
    ax.fill_between(its, mean - std, mean + std, alpha=0.2, label="+- std")
    if "exact_match" in rows[0]:
        ax.plot(its, _column(rows, "exact_match"), ls="--", label="exact match")
    # the axis follows the curves: a baseline far above a short run's rewards would flatten them, so it is drawn
    # only where it falls within them, and named at the edge otherwise
    shown = np.concatenate([mean - std, mean + std] + ([_column(rows, "exact_match")] if "exact_match" in rows[0] else []))
    lo, hi = float(np.nanmin(shown)), float(np.nanmax(shown))
    pad = max(0.05 * (hi - lo), 0.01)
    ax.set_ylim(lo - pad, hi + pad)
    baseline = summary.get("prompt_independent_baseline")
    if baseline is not None and lo - pad <= baseline <= hi + pad:
        ax.axhline(baseline, color="gray", ls=":", label="prompt-independent baseline")
    elif baseline is not None:
        above = baseline > hi
        ax.annotate(f"prompt-independent baseline {baseline:.3f} ({'above' if above else 'below'})",
                    xy=(0.01, 0.97 if above else 0.03), xycoords="axes fraction", va="top" if above else "bottom",
                    fontsize=8, color="gray")
    ax.set(xlabel="iteration", ylabel="reward", title="Reward over iterations")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def _length_hist(rows: list[dict]) -> dict | None:
    """Sum the per-iteration histograms (same binning within one run) -> {"bin_width", ..., "by_age"}."""
    hists = [r["response_length_hist"] for r in rows if r.get("response_length_hist")]
    if not hists:
        return None
    total = {k: hists[-1][k] for k in ("bin_width", "max_tokens", "round_tokens")}
    by_age: dict[str, np.ndarray] = {}
    for h in hists:
        for age, counts in h["by_age"].items():
            counts = np.asarray(counts)
            by_age[age] = by_age.get(age, np.zeros_like(counts)) + counts
    total["by_age"] = dict(sorted(by_age.items(), key=lambda kv: int(kv[0])))
    return total


def plot_lengths(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    hist = _length_hist(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if hist is not None:
        width = hist["bin_width"]
        total = sum(hist["by_age"].values())
        x = np.arange(len(total)) * width
        left.bar(x, total, width=width, align="edge", color="lightgray", label="all trained samples")
        for age, counts in hist["by_age"].items():  # lines, not stacked bars: stacks mislead on a log axis
            label = "age 0: loaded and trained in one iteration" if age == "0" else \
                f"age {age}: waited {age} iteration(s) in the dock"
            left.step(np.append(x, x[-1] + width), np.append(counts, counts[-1]), where="post", label=label)
        cut = hist["round_tokens"]
        for k in range(1, hist["max_tokens"] // max(cut, 1)):
            left.axvline(k * cut, color="gray", ls="--", lw=1, label="partial-rollout cut (round end)" if k == 1 else None)
        left.axvline(hist["max_tokens"], color="red", lw=1.5, label="max_tokens")
        left.set_yscale("log")
        left.set(xlabel="response length (tokens)", ylabel="trained samples (log)",
                 title="Response length distribution (all iterations)")
        left.legend(fontsize=7)
    else:
        left.text(0.5, 0.5, "no per-sample lengths recorded", ha="center", va="center")
        left.set_axis_off()
    its = _column(rows, "iteration")
    if hist is not None:  # below the series (they often sit on it) and above their top
        right.axhline(hist["max_tokens"], color="red", lw=1, ls="--", alpha=0.6, zorder=1, label="max_tokens")
        right.set_ylim(0, hist["max_tokens"] * 1.1)
    for key, label, marker in (("response_length_p50", "p50", "o"), ("response_length_p90", "p90", "s"),
                               ("response_length_max", "max", "^")):
        if key in rows[0]:
            right.plot(its, _column(rows, key), marker=marker, ms=4, zorder=3, label=label)
    right.set(xlabel="iteration", ylabel="tokens", title="Response length per iteration (the tail)")
    right.legend(fontsize=8)
    _save(fig, path)


def plot_carryover(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    its = _column(rows, "iteration")
    ages = sorted({a for r in rows for a in (r.get("age_histogram") or {})}, key=int)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(rows))
    for age in ages:
        counts = np.array([float((r.get("age_histogram") or {}).get(age, 0)) for r in rows])
        ax.bar(its, counts, bottom=bottom, label="not generated yet (age 0)" if age == "0" else
               f"carried over, age {age}")
        bottom += counts
    ax.plot(its, _column(rows, "partial_rows", 0.0), color="black", marker="o", ms=3, label="partial rows")
    ax.set(xlabel="iteration", ylabel="rows in the dock after clear",
           title="Rows carried over to the next iteration, by age")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_task_time(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    its = _column(rows, "iteration")
    names = [t for t in TASK_ORDER if any(t in (r.get("task_s") or {}) for r in rows)]
    names += sorted({t for r in rows for t in (r.get("task_s") or {})} - set(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    bottom = np.zeros(len(rows))
    for name in names:
        sec = np.array([float((r.get("task_s") or {}).get(name, 0.0)) for r in rows])
        ax.bar(its, sec, bottom=bottom, label=name)
        bottom += sec
    ax.set(xlabel="iteration", ylabel="seconds", title="Time per task")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    _save(fig, path)


def plot_is_weights(rows: list[dict], path: Path) -> None:
    """Left: each iteration's IS-weight histogram (fixed log-spaced bins) as a column, coloured by the share
    of that iteration's tokens; right: the quantiles per iteration. Far from 1 = stale or mismatched tokens."""
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FuncFormatter

    plt = _pyplot()
    hists = [(float(r["iteration"]), r["is_weight_hist"]) for r in rows
             if (r.get("is_weight_hist") or {}).get("counts")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if hists:
        edges = np.asarray(hists[-1][1]["edges"], dtype=float)
        its = np.array([it for it, _ in hists])
        counts = np.array([h["counts"] for _, h in hists], dtype=float)  # [iterations, bins]
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        x = np.append(its - 0.5, its[-1] + 0.5)
        mesh = left.pcolormesh(x, edges, np.ma.masked_equal(share.T, 0.0), norm=LogNorm(vmin=1e-4, vmax=1.0),
                               cmap="viridis", shading="flat")
        fig.colorbar(mesh, ax=left, label="share of trained tokens")
        left.axhline(1.0, color="white", ls="--", lw=1)
        left.set_yscale("log")
        left.set(xlabel="iteration", ylabel="exp(old - rollout) (end bins hold the tails)",
                 title="IS weight histogram per iteration")
    else:
        left.text(0.5, 0.5, "no IS-weight histograms recorded", ha="center", va="center")
        left.set_axis_off()
    its = _column(rows, "iteration")
    for key, label in (("is_weight_p50", "p50"), ("is_weight_p90", "p90"), ("is_weight_p99", "p99"),
                       ("is_weight_max", "max")):
        if any(key in r for r in rows):
            right.plot(its, _column(rows, key), marker="o", ms=3, label=label)
    right.axhline(1.0, color="gray", ls=":", lw=1, label="on-policy (1)")
    right.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # log-axis ticks as 1, 10, 1.2 (not 10^0, 1.2 x 10^0)
    right.yaxis.set_major_formatter(plain)
    low, high = right.get_ylim()
    if high / low < 10:  # within a decade only minor ticks fall inside: label them
        right.yaxis.set_minor_formatter(plain)
    right.set(xlabel="iteration", ylabel="IS weight", title="IS weight quantiles per iteration")
    right.legend(fontsize=8)
    _save(fig, path)


def _predicted_pairs(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (iteration, predicted, true) float64[P] over every trained group that had a prediction (metrics.jsonl's
    predicted_group_len / true_group_len; None: no prediction)."""
    pairs = [(float(r["iteration"]), p, t) for r in rows
             for p, t in zip(r.get("predicted_group_len") or [], r.get("true_group_len") or []) if p is not None]
    return tuple(np.array([pair[k] for pair in pairs], dtype=float) for k in range(3))


def plot_predictions(rows: list[dict], path: Path) -> None:
    """Left: each trained group's predicted (the per-prompt length history's value when it started) vs true mean
    response length, coloured by iteration; right: predictor_r and the share of groups with a prediction per
    iteration. A run without predictions (no prompt recurred yet, or metrics from before them) says so."""
    plt = _pyplot()
    its, predicted, true = _predicted_pairs(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if len(its):
        dots = left.scatter(predicted, true, c=its, cmap="viridis", s=14, alpha=0.8)
        fig.colorbar(dots, ax=left, label="iteration")
        top = float(max(predicted.max(), true.max())) * 1.05
        left.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="true = predicted")
        left.set(xlim=(0, top), ylim=(0, top), xlabel="predicted mean length (tokens)",
                 ylabel="true mean length (tokens)", title="Group length: predicted (history) vs true")
        left.legend(fontsize=8, loc="upper left")
    else:
        left.text(0.5, 0.5, "no length predictions recorded\n(no prompt had come back from an earlier epoch)",
                  ha="center", va="center")
        left.set_axis_off()
    recorded = [r for r in rows if "predicted_groups" in r]
    if recorded:
        x = np.array([float(r["iteration"]) for r in recorded])
        corr = np.array([np.nan if r.get("predictor_r") is None else float(r["predictor_r"]) for r in recorded])
        share = np.array([r["predicted_groups"] / max(1, len(r.get("true_group_len") or [])) for r in recorded])
        right.plot(x, corr, marker="o", ms=4, label="predictor_r (Pearson, groups with a prediction)")
        right.plot(x, share, marker="s", ms=3, ls=":", label="share of groups with a prediction")
        right.axhline(0.0, color="gray", lw=0.8)
        right.set_ylim(-1.05, 1.05)
        right.legend(fontsize=8, loc="best")
    else:
        right.text(0.5, 0.5, "no predictions in metrics.jsonl", ha="center", va="center")
    right.set(xlabel="iteration", ylabel="correlation / share", title="Length predictor per iteration")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "iteration":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the plots (PLOTS) into run_dir/report/ and return their paths. FileNotFoundError: no metrics."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} has no iterations: is {run_dir} a run directory "
                                "(run_dir of `spillover train`)?")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    paths = [out / f"{name}.png" for name in PLOTS]
    plot_reward(rows, summary, paths[0])
    plot_lengths(rows, paths[1])
    plot_carryover(rows, paths[2])
    plot_task_time(rows, paths[3])
    plot_is_weights(rows, paths[4])
    plot_predictions(rows, paths[5])
    return paths


def report_markdown(run_dir: Path, plots: list[Path], summary: dict) -> str:
    """The report as markdown with the plots inline (data URIs), for a Prefect artifact."""
    lines = [f"## Run report: `{run_dir}`", "", "| " + " | ".join(summary) + " |",
             "|" + "---|" * len(summary), "| " + " | ".join(_fmt(v) for v in summary.values()) + " |", ""]
    for path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        lines += [f"**{path.stem}** (`{path}`)", "", f"![{path.stem}](data:image/png;base64,{data})", ""]
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build_report(run_dir: str | Path, summary: dict) -> tuple[list[Path], str]:
    """The plots and their markdown page, for RunTracker.finish(report=...)."""
    plots = write_report(run_dir)
    return plots, report_markdown(Path(run_dir), plots, summary)
