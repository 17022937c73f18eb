"""The real path with chat prompts: a Parquet file of chat-message prompts with additional keys trains through
`spillover train` (in process: the same parsing, flow and exit codes as the script), the keys reach the reward
function in every iteration, also for groups carried over in a checkpoint and trained after `resume`, and
`spillover eval` scores the newest verified policy (and an HF folder) into <dir>/eval/<name>.json.
Bad inputs exit 2 naming the file and line."""
from __future__ import annotations

import contextlib
import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from small_run import SMALL_RUN

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # two training runs, a resume and three evals: ~2 min
SMALL = [*SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false", "engines.rollout_num_gpus=1",
         "grpo.reward_function_path=test_eval_cli.metadata_reward", "data.additional_keys=[id,level]",
         "data.system_prompt=answer.", "rollout.max_model_len=64", "rollout.stop=[\"!\"]"]
SEEN: list[tuple[str, dict]] = []  # (label, metadata) per reward call, in this process


def metadata_reward(response: str, label, metadata) -> float:
    """Checks that every response arrives with its own prompt's additional keys; rewards varied lengths."""
    assert metadata == {"id": f"q{label}", "level": int(label) % 3}, (label, metadata)
    SEEN.append((label, metadata))
    return (len(response) % 4) / 4


def spillover(*argv: str, parts=None) -> tuple[int, str, str]:
    from spillover.flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv), parts)
    return code, out.getvalue(), err.getvalue()


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("spillover: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def chat_prompts(path, count: int = 24):
    rows = [{"messages": [{"role": "user", "content": f"what is {n}+{n}?"}], "answer": str(2 * n),
             "id": f"q{2 * n}", "level": (2 * n) % 3} for n in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def trained(prefect_harness, warm_pool, tmp_path_factory):
    """Two iterations trained; then the newest checkpoint goes and `resume` redoes iteration 1 from checkpoint 0,
    whose dock holds the groups loaded in iteration 0 and trained in iteration 1 (partial rollout loads 2 x GBS)."""
    import shutil

    folder = tmp_path_factory.mktemp("chat_run")
    data, run_dir = chat_prompts(folder / "train.parquet"), folder / "run"
    keys = ["data.prompt_key=messages", "data.label_key=answer", f"data.prompts_path={data}"]
    SEEN.clear()
    # on the session's kept engines and learners (tests/fixtures_warm.py)
    code, _, err = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *keys,
                             "schedule.num_iterations=2", parts=warm_pool)
    assert code == 0, err[-3000:]
    first = list(SEEN)
    shutil.rmtree(run_dir / "checkpoints" / "ckpt-00000001")
    code, _, err = spillover("resume", str(run_dir), parts=warm_pool)
    assert code == 0, err[-3000:]
    return run_dir, data, first, SEEN[len(first):]


def test_additional_keys_reach_the_reward_across_checkpoint_and_resume(trained):
    run_dir, _, first, redone = trained
    samples = 4 * 4  # GBS x n per iteration
    assert len(first) == 2 * samples and len(redone) == samples
    # the redone iteration trains the groups checkpoint 0 carried in its dock, each with its own keys
    assert sorted(label for label, _ in redone) == sorted(label for label, _ in first[samples:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]


def test_eval_writes_pass_at_1_and_pass_at_k(trained, warm_parts, tmp_path):
    run_dir, data, _, _ = trained
    SEEN.clear()
    code, out, err = spillover("eval", str(run_dir), "--data", str(data), "eval.k=2", "--name", "chat",
                               parts=warm_parts)
    assert code == 0, err[-3000:]
    result = json.loads((run_dir / "eval" / "chat.json").read_text())
    assert result["kind"] == "checkpoint" and result["checkpoint_iteration"] == 1 and result["weight_version"] == 2
    assert result["prompts"] == 24 and result["k"] == 2
    assert 0 <= result["pass@1"] <= result["pass@2"] <= 1 and "pass@1 (greedy)" in out
    assert len(SEEN) == 24 * 3  # greedy + 2 samples per prompt, each with its metadata
    policy = run_dir / "eval" / "policy-ckpt-00000001"
    assert (policy / "model.safetensors").is_file() and (policy / "chat_template.jinja").is_file()
    config = tmp_path / "eval.yaml"  # an HF folder takes its settings from --config (e.g. a configs/gpu recipe)
    config.write_text("data: {prompt_key: messages, label_key: answer, additional_keys: [id, level], "
                      "system_prompt: answer.}\nrollout: {max_tokens: 16}\n"
                      "grpo: {reward_function_path: test_eval_cli.metadata_reward}\n")
    code, _, err = spillover("eval", str(policy), "--config", str(config), "--data", str(data), "eval.k=1",
                             "engines.rollout_num_gpus=1", parts=warm_parts)
    assert code == 0, err[-3000:]
    assert json.loads((policy / "eval" / "train.json").read_text())["kind"] == "model_folder"


def test_eval_without_data_scores_every_eval_set_and_seeded_sampling_repeats(trained, warm_parts, tmp_path):
    """No --data: each data set of the run's data.eval_paths, one result file each. With seeded sampling
    (rollout.deterministic_sampling) every sampled request carries a seed from model.seed: a second eval of the same
    checkpoint draws the same responses, so its pass@k and sampled reward are the same."""
    run_dir, data, _, _ = trained
    other = chat_prompts(tmp_path / "other.parquet", count=8)
    results = []
    for _ in range(2):
        code, out, err = spillover("eval", str(run_dir), f"data.eval_paths={{chat: {data}, other: {other}}}",
                                   "rollout.deterministic_sampling=true", "eval.k=3", parts=warm_parts)
        assert code == 0, err[-3000:]
        assert out.count("pass@1 (greedy)") == 2
        results.append({name: json.loads((run_dir / "eval" / f"{name}.json").read_text()) for name in ("chat", "other")})
    first, second = results
    assert (first["chat"]["prompts"], first["other"]["prompts"]) == (24, 8) and first["chat"]["seed"] == 0
    for name in ("chat", "other"):
        assert [first[name][k] for k in ("pass@1", "pass@3", "mean@k", "reward_sampled")] == \
               [second[name][k] for k in ("pass@1", "pass@3", "mean@k", "reward_sampled")]
    code, _, err = spillover("eval", str(run_dir), parts=warm_parts)  # neither --data nor data.eval_paths
    assert code == 2 and "pass --data FILE, or set data.eval_paths" in error_line(err)


@pytest.mark.parametrize("prompt, expected", [
    (42, r"bad.jsonl:2: 'messages' must be a string \(the prompt text\); got number 42"),
    ([{"role": "user"}], r"bad.jsonl:2: 'messages' message #1 has no 'content'"),
    ([{"role": "wizard", "content": "hi"}], r"bad.jsonl:2: 'messages' message #1 has unknown role \"wizard\""),
    (["hi"], r"bad.jsonl:2: 'messages' must be a string .*got array"),
], ids=["number", "no-content", "unknown-role", "list-of-strings"])
def test_bad_chat_prompts_exit_2_naming_file_and_line(trained, prompt, expected, tmp_path):
    run_dir = trained[0]
    good = {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2", "id": "q2", "level": 2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "messages": prompt}) + "\n")
    code, _, err = spillover("eval", str(run_dir), "--data", str(bad))
    assert code == 2 and re.search(expected, error_line(err)) and str(bad) in error_line(err), err[-2000:]
    code, _, err = spillover("train", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", *SMALL,
                             "data.prompt_key=messages", "data.label_key=answer", f"data.prompts_path={bad}")
    assert code == 2 and re.search(expected, error_line(err)), err[-2000:]


def test_eval_refuses_what_it_cannot_evaluate(trained, tmp_path):
    run_dir, data, _, _ = trained
    code, _, err = spillover("eval", str(tmp_path), "--data", str(data))
    assert code == 2 and "neither a run dir" in error_line(err)
    code, _, err = spillover("eval", str(run_dir), "--config", "configs/tiny.yaml", "--data", str(data))
    assert code == 2 and "--config is for HF model folders" in error_line(err)
    code, _, err = spillover("eval", str(run_dir), "--data", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl" in error_line(err) and "does not exist" in error_line(err)
    empty_run = tmp_path / "fresh"
    empty_run.mkdir()
    (empty_run / "config.json").write_text((run_dir / "config.json").read_text())
    code, _, err = spillover("eval", str(empty_run), "--data", str(data), f"run_dir={empty_run}")
    assert code == 2 and "no verified checkpoint" in error_line(err), err[-2000:]
