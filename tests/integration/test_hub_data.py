"""Data files by Hub path (`data.prompts_path` / `data.eval_paths`: hf://datasets/ORG/NAME[@REVISION]/FILE, issue 40),
through real `spillover` processes and the real huggingface_hub client, with nothing reaching the network: HF_ENDPOINT
points at a stand-in Hub on 127.0.0.1 (tests/hub_endpoint.py) that answers hf_hub_download's requests as the Hub
does, and HF_HOME is a temporary folder. huggingface_hub reads HF_ENDPOINT when it is imported, hence processes.

Parquet and JSON Lines files of GSM8K's and MATH's own shape are fetched into huggingface_hub's cache and read with
data.format=gsm8k and math; a bad row is named by its Hub path and line; a missing file, repo or revision, an
unreachable Hub and an uncached file offline are one line each. (A run that records the commit of its Hub data and
resumes on it: tests/integration/test_hub_models.py, beside the models it records.)"""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from encoded_rows import jsonl, parquet
from hub_endpoint import HubEndpoint
from small_run import SMALL_RUN
from test_check_cli import SPILLOVER, refused_once, spillover

GSM8K, MATH = "datasets/spillover-test/gsm8k", "datasets/spillover-test/math"
GSM8K_ROWS = [{"question": f"Natalia sold clips to {n} of her friends in April, and then she sold half as many "
                           "clips in May. How many clips did Natalia sell altogether in April and May?",
               "answer": f"Natalia sold {n}/2 = <<{n}/2={n // 2}>>{n // 2} clips in May.\n"
                         f"Natalia sold {n}+{n // 2} = <<{n}+{n // 2}={n + n // 2}>>{n + n // 2} clips altogether.\n"
                         f"#### {n + n // 2}"} for n in (48, 50, 64, 80)]
MATH_ROWS = [{"problem": f"What is ${n} + {n}$?", "solution": f"${n} + {n} = \\boxed{{{2 * n}}}$.",
              "level": "Level 1", "type": "Prealgebra"} for n in (1, 2, 3, 4)]
CHECK = ["check", "--config", "configs/tiny.yaml", *SMALL_RUN, "data.over_long_prompts=truncate",
         "grpo.reward_function_path=spillover.rollout.builtin.math_reward.reward"]


@pytest.fixture
def hub():
    """The stand-in Hub holding GSM8K- and MATH-shaped data sets as the Hub's own repos lay them out."""
    with HubEndpoint() as hub:
        bad = [GSM8K_ROWS[0], {**GSM8K_ROWS[1], "answer": "no final line"}]
        hub.commit(GSM8K, {"main/train-00000-of-00001.parquet": parquet(GSM8K_ROWS),
                           "main/test.jsonl": jsonl(GSM8K_ROWS), "main/bad.jsonl": jsonl(bad)})
        hub.commit(MATH, {"train.jsonl": jsonl(MATH_ROWS), "test/algebra.parquet": parquet(MATH_ROWS)})
        yield hub


def online(hub: HubEndpoint, tmp_path: Path, **extra: str) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", **extra}


def hf(repo: str, file: str, revision: str | None = None) -> str:
    return f"hf://{repo}{f'@{revision}' if revision else ''}/{file}"


def downloads(hub: HubEndpoint) -> set[str]:
    """The files the stand-in Hub sent (GET of a resolve/ route)."""
    return {path for method, path in hub.requests if method == "GET" and "/resolve/" in path}


def test_check_reads_gsm8k_and_math_from_hub_parquet_and_json_lines(hub, tmp_path):
    env = online(hub, tmp_path)
    runs = {"gsm8k": [f"run_dir={tmp_path / 'g'}", "data.format=gsm8k",
                      f"data.prompts_path={hf(GSM8K, 'main/train-00000-of-00001.parquet')}",
                      f'data.eval_paths={{"test": "{hf(GSM8K, "main/test.jsonl")}"}}'],
            "math": [f"run_dir={tmp_path / 'm'}", "data.format=math", f"data.prompts_path={hf(MATH, 'train.jsonl')}",
                     f'data.eval_paths={{"algebra": "{hf(MATH, "test/algebra.parquet", "main")}"}}'],
            "bad": [f"run_dir={tmp_path / 'b'}", "data.format=gsm8k",
                    f"data.prompts_path={hf(GSM8K, 'main/bad.jsonl')}"]}
    with ThreadPoolExecutor(len(runs)) as pool:
        done = {name: pool.submit(spillover, *CHECK, *argv, **env) for name, argv in runs.items()}
    for name in ("gsm8k", "math"):
        code, _, err, _ = done[name].result()
        assert code == 0, err[-3000:]
    assert downloads(hub) == {f"/{GSM8K}/resolve/main/main/train-00000-of-00001.parquet",
                              f"/{GSM8K}/resolve/main/main/test.jsonl", f"/{GSM8K}/resolve/main/main/bad.jsonl",
                              f"/{MATH}/resolve/main/train.jsonl", f"/{MATH}/resolve/main/test/algebra.parquet"}
    code, _, err, _ = done["bad"].result()
    assert refused_once(code, err) == (
        f"spillover: {hf(GSM8K, 'main/bad.jsonl')}:2: 'answer' has no '#### <number>' final line (data.format=gsm8k; "
        "data.format=prompt_label reads prompt/label rows)")
    cached = tmp_path / "hf" / "hub" / "datasets--spillover-test--math" / "snapshots"
    assert [p.name for p in cached.glob("*/test/algebra.parquet")] == ["algebra.parquet"]  # huggingface_hub's cache


def test_a_missing_hub_file_is_one_line(hub, tmp_path):
    """A missing file, repo or revision (three lines of one check) and a file not cached offline: one line each, with
    the fix."""
    missing = [f"run_dir={tmp_path / 'a'}", "data.format=math", f"data.prompts_path={hf(MATH, 'absent.jsonl')}",
               f'data.eval_paths={{"x": "{hf("datasets/spillover-test/absent", "t.jsonl")}", '
               f'"y": "{hf(MATH, "train.jsonl", "v9")}"}}']
    one = [f"run_dir={tmp_path / 'b'}", "data.format=math", f"data.prompts_path={hf(MATH, 'train.jsonl')}"]
    with ThreadPoolExecutor(1) as pool:
        offline = pool.submit(spillover, *CHECK, *one, **online(hub, tmp_path / "o", HF_HUB_OFFLINE="1"))
        code, _, err, _ = spillover(*CHECK, *missing, **online(hub, tmp_path))
        assert code == 2, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("spillover: ")]
        assert lines == [
            f"spillover: data.prompts_path='{hf(MATH, 'absent.jsonl')}': the data set spillover-test/math has no file "
            f"'absent.jsonl' at main; its files: {hub.url}/{MATH}/tree/main",
            f"spillover: data.eval_paths.x='{hf('datasets/spillover-test/absent', 't.jsonl')}': there is no data set "
            f"spillover-test/absent on the Hub at {hub.url} (a private one needs HF_TOKEN)",
            f"spillover: data.eval_paths.y='{hf(MATH, 'train.jsonl', 'v9')}': 'v9' is not a branch, tag or commit of "
            "the data set spillover-test/math"], err[-3000:]
        code, _, err, _ = offline.result()
        line = refused_once(code, err)
        assert line.startswith(f"spillover: data.prompts_path='{hf(MATH, 'train.jsonl')}' is not in the cache at "
                               f"{tmp_path / 'o' / 'hf' / 'hub'} and HF_HUB_OFFLINE=1: run `hf download --repo-type "
                               "dataset spillover-test/math train.jsonl` or unset HF_HUB_OFFLINE"), line


def unreachable_check(tmp: Path) -> tuple[list[str], dict, str]:
    """(argv, environment, HF_ENDPOINT) of a `spillover check` of a Hub file that is not cached, with HF_ENDPOINT
    where nothing listens. huggingface_hub retries for ~23 s before it gives up, so the check runs as background work
    (tests/fixtures_early.py's unreachable_hub_check)."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PREFECT_API_URL"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp / "hf"), HF_HUB_OFFLINE="0")
    argv = [SPILLOVER, *CHECK, f"run_dir={tmp / 'run'}", "data.format=math",
            f"data.prompts_path={hf(MATH, 'train.jsonl')}"]
    return argv, env, endpoint


@pytest.mark.early("unreachable_hub_check", cpu_s=2)
def test_an_unreachable_hub_is_one_line(unreachable_hub_check):
    code, _, err = unreachable_hub_check[0].result()
    assert refused_once(code, err) == (
        f"spillover: data.prompts_path='{hf(MATH, 'train.jsonl')}' is not in the cache at "
        f"{unreachable_hub_check[1] / 'hf' / 'hub'} and the Hub at {unreachable_hub_check[2]} cannot be reached: run "
        "`hf download --repo-type dataset spillover-test/math train.jsonl` where it can, or give a local copy")

