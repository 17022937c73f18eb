"""Models named by Hub id (`model.path: ORG/NAME`, issue 40), through real `spillover` processes, with nothing
reaching the network: a Hugging Face cache is laid out in a temporary HF_HOME the way huggingface_hub writes it
(models--ORG--NAME/refs/main naming a commit, snapshots/<commit>/ holding the files) and HF_HUB_OFFLINE=1.
`spillover check` resolves the id or names what is missing in one line; a run records the commit it resolved to, and
its resume loads that commit although the cache's main has moved on (to a revision that could not be loaded)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from small_run import SMALL_RUN
from test_check_cli import refused_once, spillover

REPO_ID, OLD, NEW = "spillover-test/tiny", "a" * 40, "b" * 40


@pytest.fixture
def hub_home(tmp_path) -> Path:
    """HF_HOME with REPO_ID cached at commit OLD (the tiny model of SMALL_RUN's shape), main pointing at it."""
    from spillover.infra.config.run_config import TinyModelConfig
    from spillover.infra.models import build_tiny_model

    repo = tmp_path / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    build_tiny_model(repo / "snapshots" / OLD, TinyModelConfig(num_layers=2, hidden_size=64, intermediate_size=128))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD)
    return tmp_path / "hf"


def offline(hub_home: Path, **extra: str) -> dict:
    return {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", **extra}


def test_check_resolves_a_cached_hub_id_and_names_a_missing_one(hub_home, tmp_path):
    code, out, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                  f"model.path={REPO_ID}", *SMALL_RUN, **offline(hub_home))
    assert code == 0, err[-3000:]
    code, out, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                  "model.path=spillover-test/absent", *SMALL_RUN, **offline(hub_home))
    line = refused_once(code, err)
    assert "spillover-test/absent is not in the cache at" in line and "HF_HUB_OFFLINE=1" in line
    assert "huggingface-cli download spillover-test/absent" in line


def test_a_run_records_the_commit_it_resolved_and_its_resume_loads_that_commit(hub_home, tmp_path, ray_session):
    run_dir = tmp_path / "run"
    env = offline(hub_home, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    common = ["tracking.wandb_mode=disabled", "tracking.progress=false"]
    code, out, err, _ = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}",
                                  f"model.path={REPO_ID}", "schedule.num_iterations=1", *SMALL_RUN, *common, **env)
    assert code == 0, err[-3000:]
    recorded = json.loads((run_dir / "config.json").read_text())["model"]
    assert (recorded["path"], recorded["revision"]) == (REPO_ID, OLD)
    repo = hub_home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "snapshots" / NEW).mkdir()
    (repo / "snapshots" / NEW / "config.json").write_text("{}")  # main moved on to weights that do not load
    (repo / "refs" / "main").write_text(NEW)
    code, out, err, _ = spillover("resume", str(run_dir), "schedule.num_iterations=2", *common, **env)
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]  # on OLD: main (NEW) holds no weights and would be refused
