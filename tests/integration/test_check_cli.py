"""`spillover check` and the preflight that `train` runs first, through real `spillover` processes (exit code and the
last stderr line: the process boundary is the point), and every GPU recipe against the GPUs its header states.

The processes join no Ray cluster (RAY_ADDRESS removed): the plan is checked against `--gpus N` or this machine, and
a refused input stops before Prefect, Ray or any model starts (no temporary Prefect server, no traceback).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPILLOVER = str(Path(sys.executable).with_name("spillover"))
RECIPES = sorted((REPO / "configs" / "gpu").glob("*.yaml"))
GOOD = [json.dumps({"prompt": f"a*{n}=", "label": n}) for n in range(1, 9)]


def spillover(*argv: str, cwd: Path = REPO, **extra_env: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of a `spillover` process that joins no Ray cluster (unless extra_env
    names one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PREFECT_API_URL"))}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    proc = subprocess.run([SPILLOVER, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start


def last_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else ""


def refused_once(code: int, stderr: str) -> str:
    """A refusal: exit 2, one `spillover: ...` line, no traceback, and no Prefect server started for it."""
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr and "temporary server" not in stderr, stderr[-3000:]
    assert len([line for line in stderr.splitlines() if line.startswith("spillover: ")]) == 1, stderr[-3000:]
    return last_line(stderr)


def test_train_refuses_a_bad_prompt_line_and_a_null_label_in_one_line(tmp_path):
    """Today: found after the Prefect server started, a 30-line traceback ending in 'Stopping temporary server'; a
    null label even exited 1 (the built-in task's baseline failed on it inside the flow)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(GOOD[:2] + ['{"prompt": "a*3=", "label": 3'] + GOOD) + "\n")
    code, _, err, seconds = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                      f"data.prompts_path={bad}")
    assert re.fullmatch(rf"spillover: {re.escape(str(bad))}:3: not valid JSON .*", refused_once(code, err))
    assert not (tmp_path / "run" / "tiny_model").exists()  # refused before the model was built
    null = tmp_path / "null.jsonl"
    null.write_text("\n".join(GOOD[:4] + ['{"prompt": "a*5=", "label": null}']) + "\n")
    code, _, err, _ = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                f"data.prompts_path={null}")
    assert refused_once(code, err).startswith(f"spillover: {null}:5: label 'label' is null")


def test_check_refuses_a_bad_import_path():
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml",
                                "grpo.reward_function_path=small_run.no_such_reward")
    assert refused_once(code, err) == ("spillover: grpo.reward_function_path='small_run.no_such_reward': module "
                                       "'small_run' has no function 'no_such_reward'")


def test_check_refuses_an_impossible_gpu_count_naming_the_fields():
    """Torch engines (no SGLang import: the recipes' own refusals are checked in process below)."""
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml", "--gpus", "1", "learner.device=cuda",
                                "grpo.kl_coef=0.01", "learner.reference_placement=separate")
    line = refused_once(code, err)
    assert "the run needs 2 GPUs" in line and "--gpus 1" in line
    assert all(f in line for f in ("learner.world_size x learner.gpus_per_rank", "grpo.kl_coef > 0",
                                   "learner.reference_placement=with_policy"))


def test_check_refuses_multi_node_placement_with_local_storage():
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml", "--gpus", "4", "--nodes", "2")
    line = refused_once(code, err)
    assert "storage.url=" in line and "2 nodes" in line and "storage.url=s3://" in line


def test_check_refuses_an_unreachable_ray_cluster_at_once():
    from spillover.bench.seaweed_server import free_ports

    address = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there (ray.init would retry for minutes)
    code, _, err, seconds = spillover("check", "--config", "configs/tiny.yaml", RAY_ADDRESS=address)
    assert refused_once(code, err).startswith(f"spillover: cannot join the Ray cluster at {address}")


def test_a_healthy_check_prints_the_plan_in_seconds(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(GOOD) + "\n")
    code, out, err, seconds = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                                        f"data.prompts_path={prompts}")
    assert code == 0, err[-3000:]
    assert out.splitlines()[0].split()[:3] == ["actor", "count", "CPUs"]
    assert "policy learner" in out and "engine" in out and "this machine" in out
    assert not (tmp_path / "run").exists()  # a check writes nothing
    print(f"spillover check took {seconds:.1f} s")


def test_check_refuses_what_train_would_refuse_later(tiny_model_dir, tmp_path):
    """`check` says now what `train` refused only after start-up: a run_dir that already holds checkpoints (resume it
    or choose another), a rollout.max_model_len past the model's max_position_embeddings; a missing config file is
    named where it was looked for; a machine without GPUs gets no line about engines spanning nodes."""
    from spillover.infra.storage.checkpoint import MANIFEST

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(GOOD) + "\n")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "ckpt-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "ckpt-00000002" / MANIFEST).write_text("{}")  # what marks a checkpoint complete
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={run_dir}",
                                f"data.prompts_path={prompts}")
    line = refused_once(code, err)
    assert "already holds checkpoints (up to iteration 2)" in line and f"spillover resume {run_dir}" in line, line
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'new'}",
                                f"data.prompts_path={prompts}", f"model.path={tiny_model_dir}",
                                "rollout.max_model_len=2560", "rollout.max_tokens=2048")
    line = refused_once(code, err)
    assert "rollout.max_model_len (2560) is more than the model's max_position_embeddings (512" in line, line
    code, _, err, _ = spillover("check", "--config", "configs/tiny.yaml", cwd=tmp_path)
    line = refused_once(code, err)
    assert f"'configs/tiny.yaml' does not exist in {tmp_path}" in line and "pass --config" not in line, line


def test_check_reads_a_gsm8k_file_as_it_is_with_data_format(tmp_path):
    """data.format=gsm8k: the data set's own rows pass the preflight (every line read with the run's reader) and a
    row that is not GSM8K's is one line naming file, line and setting. In process (the same parsing and exit codes)."""
    from spillover.flows.cli import main

    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": f"what is {n}+{n}?", "answer": f"so\n#### {2 * n}"}) + "\n"
                           for n in range(6)))
    argv = ["check", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", f"data.prompts_path={raw}",
            "data.format=gsm8k", "data.additional_keys=[id]", "grpo.reward_function_path="
            "spillover.rollout.builtin.math_reward.reward"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    raw.write_text(raw.read_text() + json.dumps({"prompt": "a*1=", "label": 1}) + "\n")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(argv) == 2
    assert "gsm8k.jsonl:7" in err.getvalue() and "data.format=gsm8k" in err.getvalue(), err.getvalue()


def test_a_gpu_recipe_checked_on_a_machine_without_gpus_names_only_the_gpu_count(tmp_path):
    """This machine has no GPU: the recipe's plan falls short by its GPU count, and no engine "spans nodes"."""
    from spillover.infra.config.placement_plan import Cluster, placement_plan, plan_problems
    from spillover.infra.config.run_config import load_config

    plan = placement_plan(load_config(RECIPES[0]), 0)
    lines = plan_problems(plan, Cluster(gpus=0, cpus=2, nodes=1, gpus_per_node=0, source="this machine"), "s3://b/r")
    assert len(lines) == 1 and "GPUs" in lines[0] and "span" not in lines[0], lines


def recipe_inputs(model_dir: Path, tmp_path: Path) -> list[str]:
    """The recipes' model and data paths, pointed at a tiny model with room for their rollout.max_model_len and a
    small Parquet file with their columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from spillover.infra.models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "long_model", max_position=4096)

    data = tmp_path / "train.parquet"
    if not data.exists():
        pq.write_table(pa.table({"prompt": [f"what is {n} + {n}?" for n in range(8)],
                                 "label": [str(2 * n) for n in range(8)], "id": list(range(8)),
                                 "level": ["level 1"] * 8, "type": ["algebra"] * 8}), data)
    return [f"model.path={model_dir}", f"data.prompts_path={data}", f"run_dir={tmp_path / 'run'}"]


def header_gpus(recipe: Path) -> int:
    match = re.search(r"^# Hardware: one node, (\d+) GPUs", recipe.read_text(), re.MULTILINE)
    assert match, f"{recipe}: no '# Hardware: one node, N GPUs' header"
    return int(match.group(1))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_check_with_the_gpus_its_header_states(recipe, tiny_model_dir, tmp_path):
    """In process (spillover.flows.cli.main: the same parsing and exit codes; the processes above cover the boundary)."""
    from spillover.flows.cli import main

    gpus = header_gpus(recipe)
    for count, expected in ((gpus, 0), (gpus - 1, 2)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", "--config", str(recipe), "--gpus", str(count),
                         *recipe_inputs(tiny_model_dir, tmp_path)])
        assert code == expected, err.getvalue()
        if expected:
            [line] = err.getvalue().splitlines()
            assert f"needs {gpus} GPUs" in line and "learner.world_size" in line and "engines.rollout_num_gpus" in line
        else:
            assert f"total: {gpus} GPUs" in out.getvalue() and not err.getvalue()


def test_a_run_refuses_an_unplaceable_plan_before_any_placement_group_waits(ray_session):
    """build_run's own check (deployment runs start there, without the command line's preflight)."""
    from spillover.flows.setup import refuse_unplaceable
    from spillover.infra.config.parsing import ConfigError
    from spillover.infra.config.run_config import build_config

    gpus = ray_session.cluster_resources().get("GPU", 0)
    cfg = build_config({}, ["learner.device=cuda", "engines.backend=sglang", f"engines.rollout_num_gpus={int(gpus) + 1}"])
    with pytest.raises(ConfigError, match=rf"the run needs {int(gpus) + 2} GPUs .* but the Ray cluster has {gpus:g}"):
        refuse_unplaceable(cfg, resuming=False)
    refuse_unplaceable(build_config({}), resuming=False)  # the CPU defaults fit
