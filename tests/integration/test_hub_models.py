"""Models named by Hub id (`model.path: ORG/NAME` and `grpo.reward_models[i].path`, issue 40), through real
`spillover` processes, with nothing reaching the network: a Hugging Face cache is laid out in a temporary HF_HOME the
way huggingface_hub writes it (models--ORG--NAME/refs/main naming a commit, snapshots/<commit>/ holding the files) and
HF_HUB_OFFLINE=1. `spillover check` resolves the ids or names what is missing in one line; a run records the commit
each resolved to, and that of its Hub data (hf://datasets/..., cached the same way; fetching it from a Hub:
test_hub_data.py), and its resume loads those commits although the cache's main has moved on (to revisions that could
not be loaded, and to other data)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from small_run import SMALL_RUN
from test_check_cli import refused_once, spillover

REPO_ID, RM_ID, DATA_ID, OLD, NEW = ("spillover-test/tiny", "spillover-test/tiny-rm", "spillover-test/toy", "a" * 40,
                                     "b" * 40)
REWARD_MODEL = f'grpo.reward_models=[{{"path": "{RM_ID}", "name": "rm"}}]'
DATA = [f"data.prompts_path=hf://datasets/{DATA_ID}/train.jsonl",
        f'data.eval_paths={{"toy": "hf://datasets/{DATA_ID}@main/eval.jsonl"}}']


@pytest.fixture
def hub_home(tmp_path) -> Path:
    """HF_HOME with REPO_ID (the tiny model of SMALL_RUN's shape), RM_ID (a tiny reward model) and DATA_ID (the built-in
    task's prompts) cached at commit OLD, main pointing at it."""
    from spillover.infra.config.run_config import TinyModelConfig
    from spillover.infra.models import build_tiny_model
    from spillover.rollout.builtin.toy_task import generate_dataset
    from test_reward_models import build_classifier

    build_tiny_model(cached(tmp_path / "hf", REPO_ID, OLD),
                     TinyModelConfig(num_layers=2, hidden_size=64, intermediate_size=128))
    build_classifier(cached(tmp_path / "hf", RM_ID, OLD))
    data = cached(tmp_path / "hf", DATA_ID, OLD, "datasets")
    generate_dataset(data / "train.jsonl", 64)
    generate_dataset(data / "eval.jsonl", 4, seed=1)
    return tmp_path / "hf"


def cached(hub_home: Path, repo_id: str, commit: str, kind: str = "models") -> Path:
    """The snapshot folder of repo_id at commit in hub_home's cache, main pointing at it."""
    repo = hub_home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def offline(hub_home: Path, **extra: str) -> dict:
    return {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", **extra}


def test_check_resolves_a_cached_hub_id_and_names_a_missing_one(hub_home, tmp_path):
    code, out, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                  f"model.path={REPO_ID}", REWARD_MODEL, *SMALL_RUN, **offline(hub_home))
    assert code == 0, err[-3000:]
    code, out, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                  "model.path=spillover-test/absent", *SMALL_RUN, **offline(hub_home))
    line = refused_once(code, err)
    assert "spillover-test/absent is not in the cache at" in line and "HF_HUB_OFFLINE=1" in line
    assert "hf download spillover-test/absent" in line
    code, out, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                  'grpo.reward_models=[{"path": "spillover-test/absent-rm"}]', *SMALL_RUN,
                                  **offline(hub_home))
    assert refused_once(code, err) == (
        f"spillover: grpo.reward_models[0].path: spillover-test/absent-rm is not in the cache at {hub_home / 'hub'} "
        "and HF_HUB_OFFLINE=1: run `hf download spillover-test/absent-rm` or unset HF_HUB_OFFLINE")


def test_a_run_records_the_commit_it_resolved_and_its_resume_loads_that_commit(hub_home, tmp_path, ray_session):
    run_dir = tmp_path / "run"
    env = offline(hub_home, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    common = ["tracking.wandb_mode=disabled", "tracking.progress=false"]
    code, out, err, _ = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}",
                                  f"model.path={REPO_ID}", REWARD_MODEL, *DATA, "schedule.num_iterations=1",
                                  *SMALL_RUN, *common, **env)
    assert code == 0, err[-3000:]
    recorded = json.loads((run_dir / "config.json").read_text())
    assert (recorded["model"]["path"], recorded["model"]["revision"]) == (REPO_ID, OLD)
    assert [(rm["path"], rm["revision"]) for rm in recorded["grpo"]["reward_models"]] == [(RM_ID, OLD)]
    assert (recorded["data"]["prompts_path"], recorded["data"]["eval_paths"]) == (
        f"hf://datasets/{DATA_ID}@{OLD}/train.jsonl", {"toy": f"hf://datasets/{DATA_ID}@{OLD}/eval.jsonl"})
    for repo_id in (REPO_ID, RM_ID):  # main moves on to weights that do not load
        moved = cached(hub_home, repo_id, NEW)
        moved.mkdir()
        (moved / "config.json").write_text("{}")
    moved = cached(hub_home, DATA_ID, NEW, "datasets")  # and to one prompt, which the cursor (of 64) cannot read
    moved.mkdir()
    (moved / "train.jsonl").write_text('{"prompt": "a*1=", "label": 1}\n')
    code, out, err, _ = spillover("resume", str(run_dir), "schedule.num_iterations=2", *common, **env)
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]  # on OLD: main (NEW) holds no weights and would be refused
    assert json.loads((run_dir / "config.json").read_text())["data"] == recorded["data"]
    assert all("reward_model_rm_mean" in r for r in rows)
