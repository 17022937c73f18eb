"""Resume from checkpoints in storage: the run continues where it stopped, nothing trained twice; a finished run
trained longer (`spillover resume RUN schedule.num_iterations=N`) goes on as one longer run would."""
import json
import math

import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.storage.format_version import FormatVersionError

from small_run import SMALL_RUN
from test_train_flow import small_config


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_and_refuses_mixed_runs(prefect_harness, ray_session, warm_parts, tmp_path):
    from spillover.infra.config.run_config import load_run_config
    from spillover.flows.train import grpo_train

    run_dir = tmp_path / "run"
    grpo_train(small_config(run_dir, iterations=2), parts=warm_parts)
    assert [r["iteration"] for r in rows(run_dir)] == [0, 1]

    with pytest.raises(ConfigError, match="already holds checkpoints"):
        grpo_train(small_config(run_dir, iterations=2), parts=warm_parts)
    with pytest.raises(ConfigError, match=r"rollout.global_batch_size: checkpoint 4, config 2"):
        grpo_train(small_config(run_dir, iterations=3, **{"rollout.global_batch_size": 2,
                                                          "grpo.micro_batch_size": 8}), resume=True, parts=warm_parts)

    manifest_path = run_dir / "checkpoints" / "ckpt-00000001" / "manifest.json"
    manifest = manifest_path.read_text()
    manifest_path.write_text(manifest.replace('"spillover-checkpoint/1"', '"spillover-checkpoint/2"'))
    with pytest.raises(FormatVersionError, match=rf"{manifest_path} has spillover-checkpoint format version 2 .*"
                       "this release reads version 1 only"):  # refused, not a silent roll back to ckpt-00000000
        grpo_train(load_run_config(run_dir, ["schedule.num_iterations=3"]), resume=True, parts=warm_parts)
    manifest_path.write_text(manifest)

    cfg = load_run_config(run_dir, ["schedule.num_iterations=3"])
    summary = grpo_train(cfg, resume=True, parts=warm_parts)
    got = rows(run_dir)
    assert [r["iteration"] for r in got] == [0, 1, 2] and summary["iterations"] == 3
    trained = [g for r in got for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(12))
    assert got[2]["weight_version"] == 3  # the policy continued from version 2


def spillover(*argv: str, parts=None) -> tuple[int, str]:
    """`spillover ARGV` in process (the command line's parsing, preflight and exit codes) -> (exit code, stderr)."""
    import contextlib
    import io

    from spillover.flows.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv), parts)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def extended_run(prefect_harness, warm_pool, tmp_path_factory):
    """A finished 2-iteration run (cosine lr decay; its last iteration drained the dock), then trained longer as the
    README says: `spillover resume RUN schedule.num_iterations=4` -> its metrics rows."""
    run_dir = tmp_path_factory.mktemp("extended") / "run"
    code, err = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", "schedule.num_iterations=2",
                          *SMALL_RUN, "optimizer.lr_decay=cosine", "rollout.deterministic_sampling=true",
                          "tracking.wandb_mode=disabled", "tracking.progress=false", parts=warm_pool)
    assert code == 0, err[-3000:]
    assert rows(run_dir)[-1]["partial_rows"] == 0  # drained: the dock is empty
    code, err = spillover("resume", str(run_dir), "schedule.num_iterations=4", parts=warm_pool)
    assert code == 0, err[-3000:]
    assert f"resuming {run_dir} from checkpoint 1 (iteration 2 of 4)" in err
    got = rows(run_dir)
    assert [r["iteration"] for r in got] == [0, 1, 2, 3]
    return got


def test_a_resume_with_nothing_left_to_do_says_so_and_touches_nothing(tmp_path):
    """A finished run resumed without more iterations: one line saying so and how to train longer, exit 0; nothing
    starts (no Ray, Prefect or wandb) and nothing of the run is rewritten."""
    import subprocess
    import sys
    from pathlib import Path

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "ckpt-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "ckpt-00000002" / "manifest.json").write_text("{}")  # complete (as listed)
    (run_dir / "config.json").write_text(json.dumps({"schedule": {"num_iterations": 3}}))  # as `train` saved it
    (run_dir / "summary.json").write_text("{}")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    proc = subprocess.run([str(Path(sys.executable).with_name("spillover")), "resume", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"{run_dir} has trained all 3 iterations (checkpoint 2): nothing to resume; to train longer: "
        f"`spillover resume {run_dir} schedule.num_iterations=N` with N > 3"]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing written, nothing new


def test_training_longer_keeps_partial_rollout_on(extended_run):
    """Issue 41 item 1: the added iterations start from 2 x GBS groups again, as a fresh run does, so rows are cut
    and carried over again; before, GBS groups an iteration left nothing to cut."""
    got = extended_run
    assert got[0]["partial_rows"] > 0 and got[2]["partial_rows"] > 0  # cut rows, with tokens, carried over
    assert [r["loaded_groups"] for r in got] == [8, 0, 8, 0]  # 2 x GBS, then (after the drain) 2 x GBS again
    assert got[3]["partial_rows"] == 0  # the new last iteration drains
    assert sorted(g for r in got for g in r["trained_stream_ids"]) == list(range(4 * 4))  # each group once


def test_training_longer_continues_the_lr_decay(extended_run):
    """Issue 41 item 2: the cosine decay of the 2-iteration run (over 2 updates) goes on from where it was over the
    4 the run now has (optimizer.lr_extension=stretch, the default); before, it started over at the new horizon
    (update 2 of 4 got the lr update 1 of 2 had: a sawtooth)."""
    lrs = [r["lr"] for r in extended_run]
    top, end = 1e-3, 1e-3 * 0.1  # configs/tiny.yaml: optimizer.lr 1e-3, min_lr_ratio 0.1 (the default)
    cosine = lambda done: end + (top - end) * 0.5 * (1 + math.cos(math.pi * done))  # noqa: E731
    assert lrs[:2] == pytest.approx([cosine(0), cosine(1 / 2)])  # the run as it was trained
    # stretched: from update 1 (half the decay done) to update 4, where the end value would be reached
    assert lrs[2:] == pytest.approx([cosine(1 / 2 + 1 / 2 * 1 / 3), cosine(1 / 2 + 1 / 2 * 2 / 3)])
    assert lrs[0] > lrs[1] > lrs[2] > lrs[3] > end  # decaying on, never back up
