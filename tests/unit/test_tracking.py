"""RunTracker and its parts: metric shaping, artifact throttling, the terminal bar, wandb offline (real
wandb, no network) including resuming the same wandb run."""
from __future__ import annotations

import io
import json
import threading

from spillover.infra.tracking.report import build_report
from spillover.infra.config.run_config import load_config
from spillover.infra.tracking.prefect_artifacts import RunArtifacts, artifact_key, metrics_table
from spillover.infra.tracking.terminal_progress import TerminalProgress, progress_fields
from spillover.infra.tracking.run_tracker import RunTracker, length_histogram, summary_markdown
from spillover.tasks.results import Cleared, Evaluated, Logprobs, Rollout, Scored, Updated, iteration_row, iteration_scalars
from wandb_records import read_segments

# What the iteration's stages return (tasks/results.py), as the flow assembles them.
STAGES = [Rollout(metrics={"rounds": 3, "engine_s": 1.2}), Scored(metrics={"reward_mean": 0.5, "reward_std": 0.1,
                                                                         "response_length_p50": 7.0,
                                                                         "response_length_max": 16}),
          Logprobs(source="rollout"), Updated(metrics={"loss": 0.25, "kl": 0.01, "tis_weight_mean": 0.98, "lr": 1e-3,
                                                       "optimizer_steps": 2, "update_s": 0.4,
                                                       "old_logprob_source": "rollout"}, weight_version=4),
          Evaluated(metrics={"eval/toy": 0.4, "eval/toy-truncated_ratio": 0.1, "eval/step": 3}),
          Cleared(metrics={"partial_rows": 5, "age_histogram": {"0": 3, "1": 2}, "trained_group_ids": [1, 2]})]
TASK_S = {"generate_until_ready": 1.5, "update": 0.5}
METRICS = {**iteration_row(3, STAGES, TASK_S), "time_s": 2.1}
SCALARS = iteration_scalars(STAGES, TASK_S)


class FakeTTY(io.StringIO):
    """A terminal that records what is drawn; `drawn` is set once the text holds `until`."""

    def __init__(self, until: str = "round"):
        super().__init__()
        self.until, self.drawn = until, threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.until in self.getvalue():
            self.drawn.set()
        return written


def test_length_histogram_counts_by_age_with_bounded_bins():
    h = length_histogram([0, 3, 16, 16, 5], [0, 0, 0, 1, 1], max_tokens=16, round_tokens=8)
    assert h["bin_width"] == 1 and h["max_tokens"] == 16 and h["round_tokens"] == 8
    assert len(h["by_age"]["0"]) == 17
    assert h["by_age"]["0"][0] == 1 and h["by_age"]["0"][3] == 1 and h["by_age"]["0"][16] == 1
    assert h["by_age"]["1"][16] == 1 and h["by_age"]["1"][5] == 1 and sum(h["by_age"]["1"]) == 2
    wide = length_histogram([0, 4095, 32768], [0, 0, 2], max_tokens=32768, round_tokens=4096)
    assert len(wide["by_age"]["0"]) <= 64 and sum(wide["by_age"]["2"]) == 1 and wide["by_age"]["2"][-1] == 1


def test_stage_results_carry_their_wandb_prefix():
    p = SCALARS
    assert p["train/loss"] == 0.25 and p["train/kl"] == 0.01 and p["train/tis_weight_mean"] == 0.98
    assert p["train/lr"] == 1e-3 and p["train/optimizer_steps"] == 2 and p["time/update_s"] == 0.4
    assert p["rollout/reward_mean"] == 0.5 and p["rollout/partial_rows"] == 5 and p["rollout/rounds"] == 3
    assert p["rollout/rows_age_1"] == 2 and p["eval/toy"] == 0.4 and p["eval/step"] == 3
    assert p["time/task_generate_until_ready_s"] == 1.5 and p["time/engine_s"] == 1.2 and p["time/task_update_s"] == 0.5
    assert "iteration" not in p and not any("trained_group_ids" in k or "old_logprob" in k for k in p)
    assert METRICS["eval/toy"] == 0.4 and METRICS["loss"] == 0.25 and METRICS["task_s"] == TASK_S


def test_summary_markdown_and_metrics_table():
    md = summary_markdown(METRICS)
    assert md.startswith("### Iteration 3") and "0.500" in md and "generate_until_ready 1.50s" in md
    rows = {r["metric"]: r["value"] for r in metrics_table({**METRICS, "response_length_hist": {"by_age": {}}})}
    assert rows["reward_mean"] == "0.5" and rows["task_s.update"] == "0.5" and rows["age_histogram.1"] == "2"
    assert "trained_group_ids" not in rows and not any(k.startswith("response_length_hist") for k in rows)
    assert artifact_key("spillover", "My Run_01/x") == "spillover-my-run-01-x"


def test_progress_artifact_updates_are_throttled():
    now = [0.0]
    art = RunArtifacts("spillover-t", min_interval_s=2.0, clock=lambda: now[0])
    sent = []
    art.sink.enabled = True
    art.sink.send = sent.append
    progress = {"round": 1, "ready_groups": 1, "target_groups": 4, "tokens": 10}
    art.on_round(0, progress)                      # creates the artifact
    for t in (0.5, 1.0, 1.9):                      # within 2 s: nothing sent
        now[0] = t
        art.on_round(0, {**progress, "round": 2})
    now[0] = 2.5
    art.on_round(0, {**progress, "round": 3})      # 2 s passed: one update
    now[0] = 2.6
    art.on_round(0, {**progress, "ready_groups": 4})  # done: always sent
    now[0] = 2.7
    art.on_round(1, progress)                      # next iteration: a new artifact
    assert len(sent) == 4 and art.progress_sent == 4


def test_terminal_bar_only_on_a_tty_and_summary_lines_always():
    lines = []
    off = TerminalProgress(True, lines.append, stream=io.StringIO())
    off.update(0, {"ready_groups": 1, "target_groups": 4}, 0)
    off.line("iter 0 ...")
    assert not off.enabled and lines == ["iter 0 ..."]
    tty = FakeTTY()
    on = TerminalProgress(True, lines.append, stream=tty)
    on.update(0, {"round": 2, "ready_groups": 3, "target_groups": 4, "tokens": 500, "elapsed_s": 0.5}, 7)
    assert tty.drawn.wait(10), tty.getvalue()  # rich's refresh thread draws the bar (10 times a second)
    drawn = tty.getvalue()
    for field in ("iter    0", "3/4", "ready", "1000 tok/s", "partial    7", "round 2"):  # all in rich's 80 columns
        assert field in drawn, (field, drawn)
    on.line("iter 0 done")
    on.close()
    assert on.enabled and lines[-1] == "iter 0 done"
    f = progress_fields({"ready_groups": 3, "target_groups": 4, "tokens": 500, "elapsed_s": 0.5}, 7)
    assert f["completed"] == 3 and f["total"] == 4 and f["tokens_per_s"] == 1000 and f["partial_rows"] == 7




def _cfg(run_dir, mode="offline"):
    return load_config("configs/tiny.yaml", [f"run_dir={run_dir}", f"tracking.wandb_mode={mode}",
                                             "rollout.max_tokens=16", "rollout.max_split=2"])


def test_tracker_offline_wandb_records_iterations_and_resumes_the_same_run(tmp_path):
    cfg, lines = _cfg(tmp_path), []
    tracker = RunTracker(tmp_path, cfg.tracking, lines.append, run_config=cfg)
    tracker.start()
    run_id = tracker.wandb_run_id
    tracker.on_round({"round": 1, "ready_groups": 2, "target_groups": 4, "tokens": 40, "elapsed_s": 0.1})
    for it in range(2):
        tracker.on_iteration({**METRICS, "iteration": it, "loss": 0.5 - it / 10},
                             {**SCALARS, "train/loss": 0.5 - it / 10}, response_lengths=[16, 4], ages=[1, 0])
    summary = tracker.finish(baseline=0.3, report=build_report)
    tracker.close()
    assert run_id and summary["iterations"] == 2 and len(lines) == 2 and lines[0].startswith("iter    0")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["response_length_hist"]["by_age"]["1"][16] == 1
    assert sorted(p.name for p in (tmp_path / "report").iterdir())[0] == "carryover.png"

    resumed = RunTracker(tmp_path, cfg.tracking, lines.append, run_config=cfg, resume_wandb_id=run_id)
    resumed.start(resumed=True, first_iteration=2)
    assert resumed.wandb_run_id == run_id
    resumed.on_iteration({**METRICS, "iteration": 2, "loss": 0.2}, {**SCALARS, "train/loss": 0.2})
    resumed.finish(baseline=None)
    resumed.close()
    segments = read_segments(tmp_path, 2)
    assert [(s["run_id"], s["exited"]) for s in segments] == [(run_id, True), (run_id, True)]
    logged = [(int(h["iteration"]), float(h["train/loss"])) for s in segments for h in s["history"]
              if "train/loss" in h]
    assert logged == [(0, 0.5), (1, 0.4), (2, 0.2)]
    assert any("report/reward._type" in h for h in segments[0]["history"])  # the plots, as wandb images


def test_tracker_disabled_wandb_and_no_prefect_run(tmp_path):
    cfg = _cfg(tmp_path, "disabled")
    tracker = RunTracker(tmp_path, cfg.tracking, lambda _: None, run_config=cfg)
    tracker.start()
    tracker.on_iteration(dict(METRICS), SCALARS)
    tracker.close()  # not finished: still closes cleanly
    assert tracker.wandb_run_id is None and not (tmp_path / "wandb").exists()
    assert not tracker.artifacts.sink.enabled
