"""Resume from checkpoints in storage: the run continues where it stopped, nothing trained twice."""
import json

import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.storage.format_version import FormatVersionError

from test_train_flow import small_config


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_and_refuses_mixed_runs(prefect_harness, ray_session, warm_parts, tmp_path):
    from spillover.flows.setup import load_run_config
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
