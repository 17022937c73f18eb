"""`spillover report RUN_DIR`: the PNG plots from metrics.jsonl (with and without the length and IS-weight
histograms and the length predictions)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spillover.flows.cli import EXIT_BAD_INPUT, EXIT_OK, main
from spillover.infra.tracking.report import PLOTS, report_markdown, write_report
from spillover.infra.tracking.run_tracker import append_metrics, length_histogram
from spillover.tasks.learner.offpolicy_metrics import OffPolicyStats

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(n: int, with_hist: bool = True) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for it in range(n):
        lengths = np.minimum(rng.geometric(0.15, size=64), 32)
        ages = (rng.random(64) < 0.2).astype(int)
        row = {"iteration": it, "reward_mean": 0.2 + it / 50, "reward_std": 0.1, "exact_match": it / 40,
               "response_length_p50": float(np.median(lengths)), "response_length_p90": float(np.percentile(lengths, 90)),
               "response_length_max": int(lengths.max()), "partial_rows": int(rng.integers(0, 9)),
               "age_histogram": {"0": 40, "1": int(rng.integers(0, 9))},
               "task_s": {"load_prompts": 0.01, "generate_until_ready": 0.4, "compute_reward": 0.02, "update": 0.2,
                          "clear_and_age_sort": 0.01}}
        if with_hist:
            row["response_length_hist"] = length_histogram(lengths, ages, max_tokens=32, round_tokens=16)
            row.update(_learner_off_policy_metrics(rng, it))
            row.update(_predictions(rng, it))
        rows.append(row)
    return rows


def _predictions(rng, iteration: int, groups: int = 4) -> dict:
    """What clear_and_age_sort records (rollout/dock/length_history.prediction_metrics) for a run whose prompts come
    back from iteration 2 on: none predicted before, then a prediction near each group's true length."""
    from spillover.rollout.dock.length_history import prediction_metrics

    true = rng.integers(2, 32, size=groups).astype(float)
    predicted = true + rng.normal(0, 3, size=groups) if iteration >= 2 else np.full(groups, np.nan)
    return prediction_metrics(predicted, true)


def _learner_off_policy_metrics(rng, iteration: int) -> dict:
    """What the learner's update returns (OffPolicyStats.metrics), for 64 x 8 tokens drifting apart."""
    stats = OffPolicyStats("tis", current_version=iteration)
    old = torch.from_numpy(rng.normal(-2.0, 0.5, (64, 8)))
    rollout = old + torch.from_numpy(rng.normal(0.0, 0.1 + 0.1 * iteration, (64, 8)))
    mask, versions = torch.ones(64, 8), torch.full((64, 8), iteration, dtype=torch.long)
    stats.add(versions, mask, old, rollout, mask)
    return json.loads(json.dumps(stats.metrics()))  # as read back from metrics.jsonl


@pytest.mark.parametrize("with_hist", [True, False])
def test_report_writes_the_pngs(tmp_path, with_hist):
    for row in _rows(6, with_hist):
        append_metrics(tmp_path, row)
    (tmp_path / "summary.json").write_text(json.dumps({"iterations": 6, "prompt_independent_baseline": 0.37}))
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == [f"{name}.png" for name in PLOTS]
    for p in paths:
        assert p.parent == tmp_path / "report" and p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    md = report_markdown(tmp_path, paths, {"iterations": 6, "reward_rise": 0.1})
    assert md.count("data:image/png;base64,") == len(PLOTS) == 6 and "| 6 | 0.1 |" in md


def test_report_cli_exit_codes(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    for row in _rows(2):
        append_metrics(tmp_path / "run", row)
    assert main(["report", str(tmp_path / "run")]) == EXIT_OK
    assert capsys.readouterr().out.count(".png") == len(PLOTS)
    assert main(["report", str(tmp_path / "missing")]) == EXIT_BAD_INPUT
    assert "has no iterations" in capsys.readouterr().err


def test_plots_keep_short_runs_readable(tmp_path, monkeypatch):
    """A short run's rewards far below the baseline keep the axis (the baseline is named at the edge, not drawn);
    p90 and max draw above the max_tokens line; the task-time legend sits beside the bars."""
    import spillover.infra.tracking.report as report

    figures = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.__setitem__(path.stem, fig))
    rows = _rows(4)
    for r in rows:
        r["reward_mean"], r["reward_std"], r["exact_match"] = 0.01 + r["iteration"] * 0.005, 0.004, 0.0
    report.plot_reward(rows, {"prompt_independent_baseline": 0.37}, tmp_path / "reward.png")
    ax = figures["reward"].axes[0]
    assert ax.get_ylim()[1] < 0.1 and "0.370 (above)" in " ".join(t.get_text() for t in ax.texts)
    report.plot_lengths(rows, tmp_path / "lengths.png")
    right = figures["lengths"].axes[1]
    limit = [line for line in right.get_lines() if line.get_label() == "max_tokens"][0]
    assert right.get_ylim()[1] > 32 and all(line.get_zorder() > limit.get_zorder() for line in right.get_lines()
                                            if line.get_label() in ("p90", "max"))
    report.plot_task_time(rows, tmp_path / "task_time.png")
    ax = figures["task_time"].axes[0]
    figures["task_time"].canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # outside the plot area


def test_predictions_plot_draws_predicted_against_true_and_runs_without_predictions(tmp_path, monkeypatch):
    """predictions.png: a dot per trained group with a prediction at (predicted, true), coloured by its iteration, and
    predictor_r per iteration (a gap where there was none); a run with no prediction at all (start_order oldest in its
    first epoch, or metrics from before the predictions) draws the message instead of failing."""
    import spillover.infra.tracking.report as report

    figures = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.__setitem__(path.stem, fig))
    rows = json.loads(json.dumps(_rows(5)))  # as read back from metrics.jsonl (None for a missing prediction)
    report.plot_predictions(rows, tmp_path / "predictions.png")
    left, right, _ = figures["predictions"].axes  # the last one: the iteration colour bar
    dots = left.collections[0]
    expected = [[p, t] for r in rows[2:] for p, t in zip(r["predicted_group_len"], r["true_group_len"])]
    assert dots.get_offsets().tolist() == expected and len(expected) == 12
    assert dots.get_array().tolist() == [2.0] * 4 + [3.0] * 4 + [4.0] * 4  # coloured by iteration
    corr = [line for line in right.get_lines() if line.get_label().startswith("predictor_r")][0]
    ys = corr.get_ydata()
    assert np.isnan(ys[:2]).all() and ys[2:].tolist() == [r["predictor_r"] for r in rows[2:]]

    for r in rows:  # nothing predicted anywhere
        r.update(predicted_group_len=[None] * 4, predicted_groups=0, predictor_r=None)
    report.plot_predictions(rows, tmp_path / "predictions.png")
    left = figures["predictions"].axes[0]
    assert "no length predictions recorded" in left.texts[0].get_text() and not left.collections
    report.plot_predictions([{"iteration": 0}], tmp_path / "predictions.png")  # metrics from before the keys
    assert "no predictions" in figures["predictions"].axes[1].texts[0].get_text()
