"""Bad inputs through the command line (`spillover.flows.cli.main`, in process: the same argument parsing, flow and
exit codes as the `spillover` script, without paying a process start per case): each one exits 2 with one
clear line on stderr naming the input and the fix, and loses no data -- a later good run or resume goes on
from the last checkpoint with every prompt group trained exactly once.

The parsing rules themselves are unit-tested (tests/unit/test_toy_task_and_data.py, test_tasks_pure.py,
tests/integration/test_storage.py, test_checkpoint.py); here they are checked end to end.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import re

import pytest

from small_run import SMALL_RUN

pytestmark = pytest.mark.timeout(900)
SMALL = ["schedule.num_iterations=3", *SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false"]
MAX_PROMPT = 32 - 16  # rollout.max_model_len - rollout.max_tokens
SAMPLES_PER_ITERATION = 4 * 4
REWARD_CALLS = {"n": 0}


def nan_after_first_iteration(response: str, label, **_) -> float:
    """The built-in reward for iteration 0's samples, NaN from then on (a scorer that broke mid-run)."""
    from spillover.rollout.builtin.toy_task import reward

    REWARD_CALLS["n"] += 1
    return reward(response, label) if REWARD_CALLS["n"] <= SAMPLES_PER_ITERATION else math.nan


def string_reward(response: str, label, **_):
    return "0.5"


def spillover(*argv: str, parts=None) -> tuple[int, str]:
    """Run the command line in this process -> (exit code, what it wrote to sys.stderr). Not capsys/capfd:
    Prefect's console log handler keeps the stream it first saw, and theirs are closed after each test."""
    from spillover.flows.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(list(argv), parts)
    return code, err.getvalue()


def with_records(logger: str, fn, *args):
    """fn(*args) plus the records `logger` emitted meanwhile. Not caplog: the first flow run of a session
    configures Prefect's logging, which replaces the root logger's handlers (caplog's among them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        return (*fn(*args), records)
    finally:
        target.removeHandler(handler)


def train(run_dir, *extra: str, parts=None) -> tuple[int, str]:
    return spillover("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *extra, parts=parts)


def error_line(stderr: str) -> str:
    """The one `spillover: ...` line the command prints for a refused input."""
    lines = [line for line in stderr.splitlines() if line.startswith("spillover: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def prompt_file(tmp_path, lines: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [json.dumps({"prompt": f"a*{n}=", "label": n}) for n in range(1, 21)]


@pytest.mark.parametrize("lines, expected", [
    (GOOD[:2] + ['{"prompt": "a*3=", "label": 3'] + GOOD[2:], r"prompts.jsonl:3: not valid JSON"),
    (GOOD[:4] + ['{"prompt": "a*5="}'], r"prompts.jsonl:5: missing key 'label' \(set data.label_key"),
    (['{"text": "a*1=", "label": 1}'] + GOOD, r"prompts.jsonl:1: missing key 'prompt' \(set data.prompt_key"),
    (GOOD[:1] + ['{"prompt": "   ", "label": 2}'], r"prompts.jsonl:2: empty prompt under 'prompt'"),
    (GOOD[:1] + [json.dumps({"prompt": "x" * 30 + "a*2=", "label": 2})],
     rf"prompt #2 has 34 tokens, more than the {MAX_PROMPT} allowed .*data.over_long_prompts=truncate"),
    (GOOD[:3] + ['{"prompt": "a*4=", "label": null}'], r"prompts.jsonl:4: label 'label' is null"),  # exited 1
], ids=["malformed-line", "missing-label", "missing-prompt", "empty-prompt", "over-long-prompt", "null-label"])
def test_bad_prompt_file_exits_2_naming_the_line(lines, expected, prefect_harness, tmp_path):
    path = prompt_file(tmp_path, lines)
    code, err = train(tmp_path / "run", f"data.prompts_path={path}")
    assert code == 2
    assert re.search(expected, error_line(err)), error_line(err)
    assert str(path) in error_line(err) or "prompt #" in error_line(err)
    assert checkpoints(tmp_path / "run") == []  # refused before anything was trained


@pytest.mark.parametrize("content, expected", [
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xed\x9d\n", r"prompts.jsonl:1: not UTF-8 text .*must be UTF-8 JSON Lines"),
    ((GOOD[0] + '\n{"prompt": 42, "label": 2}\n').encode(), r"prompts.jsonl:2: 'prompt' must be a string"),
], ids=["binary-file", "number-prompt"])
def test_binary_file_or_non_string_prompt_exits_2_naming_the_line(content, expected, prefect_harness, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    code, err = train(tmp_path / "run", f"data.prompts_path={path}")
    assert code == 2
    assert re.search(expected, error_line(err)) and str(path) in error_line(err), error_line(err)
    assert checkpoints(tmp_path / "run") == []


def test_unreachable_storage_at_start_exits_2_with_the_fix(prefect_harness, tmp_path, monkeypatch):
    """The start-up storage check retries until its deadline (10 s) on a clock that only its sleeps advance:
    the same attempts and backoffs, none of the waiting."""
    import dataclasses

    import spillover.infra.storage.store
    from spillover.bench.seaweed_server import free_ports

    now = [0.0]
    real_policy = spillover.infra.storage.store.RetryPolicy
    monkeypatch.setattr(spillover.infra.storage.store, "RetryPolicy", lambda **kw: dataclasses.replace(
        real_policy(**kw), sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0]))
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    code, err = train(tmp_path / "run", "storage.url=s3://spillover-test/run", f"storage.endpoint_url={endpoint}",
                      "storage.access_key_id=SOMEKEY", "storage.secret_access_key=never-shown-secret")
    line = error_line(err)
    assert code == 2
    assert "s3://spillover-test/run" in line and endpoint in line and "storage.endpoint_url" in line
    assert "never-shown-secret" not in err and "SOMEKEY" not in err
    assert now[0] >= 9.0  # it waited out (on the fake clock) the whole deadline


def test_wrong_credentials_exit_2_without_showing_them(prefect_harness, s3_server, tmp_path):
    code, err = train(tmp_path / "run", f"storage.url={s3_server.url('bad-keys')}",
                      f"storage.endpoint_url={s3_server.endpoint_url}", "storage.region=us-east-1",
                      f"storage.access_key_id={s3_server.access_key}", "storage.secret_access_key=wrong-secret-value")
    line = error_line(err)
    assert code == 2
    assert "refused" in line and "storage.secret_access_key" in line and s3_server.url("bad-keys") in line
    assert "wrong-secret-value" not in err and s3_server.secret_key not in err


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run_dir) -> list[tuple[int, bool]]:
    from spillover.infra.storage.checkpoint import list_checkpoints
    from spillover.infra.storage.store import open_store

    return [(c.iteration, c.complete) for c in list_checkpoints(open_store(str(run_dir / "checkpoints")))]


@pytest.mark.slow  # ~70 s: five flow runs on one run directory
def test_bad_rewards_and_mismatched_resumes_stop_clearly_and_lose_nothing(prefect_harness, ray_session, warm_parts,
                                                                          tmp_path):
    """One run through the whole list, each step on the state the previous one left:
    1. over-long prompts with data.over_long_prompts=truncate are cut and counted; the reward turns NaN in
       iteration 1 -> exit 2 naming the function and the sample; iteration 0's checkpoint stays;
    2. resume with a reward returning a string -> exit 2, nothing trained;
    3. resume with another global batch size, model or staleness bound, or with a prompt file that changed size ->
       exit 2 naming the field;
    4. resume with a good reward -> the run completes, every group trained exactly once;
    5. the newest checkpoint corrupted, then trained longer -> resume reports it, uses the previous one and completes
       the longer run."""
    run_dir = tmp_path / "run"

    def cli(*argv: str) -> tuple[int, str]:  # on the session's kept engines and learners
        return spillover(*argv, parts=warm_parts)
    long_prompts = [json.dumps({"prompt": "x" * 30 + f"a*{n}=", "label": n}) for n in (3, 4)]
    path = prompt_file(tmp_path, GOOD + long_prompts)
    REWARD_CALLS["n"] = 0
    code, err = train(run_dir, f"data.prompts_path={path}", "data.over_long_prompts=truncate",
                      "grpo.reward_function_path=test_bad_inputs.nan_after_first_iteration", parts=warm_parts)
    line = error_line(err)
    assert code == 2 and "RewardError" in line
    assert "'test_bad_inputs.nan_after_first_iteration' returned nan for sample" in line and "finite number" in line
    assert checkpoints(run_dir) == [(0, True)]
    assert [r["iteration"] for r in rows(run_dir)] == [0] and rows(run_dir)[0]["truncated_prompts"] == 2

    code, err = cli("resume", str(run_dir), "grpo.reward_function_path=test_bad_inputs.string_reward")
    assert code == 2 and "'test_bad_inputs.string_reward' returned '0.5'" in error_line(err)
    assert checkpoints(run_dir) == [(0, True)]

    for override, field in ((["rollout.global_batch_size=2", "grpo.micro_batch_size=8"],
                             "rollout.global_batch_size: checkpoint 4, config 2"),
                            (["model.tiny.hidden_size=32"], "model.tiny: checkpoint"),
                            (["rollout.max_age=5"], "rollout.max_age: checkpoint")):  # the dock keeps its bound
        code, err = cli("resume", str(run_dir), *override)
        line = error_line(err)
        assert code == 2 and "the checkpoint comes from a different run" in line and field in line, line
    path.write_text("\n".join(GOOD[2:] + long_prompts) + "\n")  # the same file with two prompts fewer
    code, err = cli("resume", str(run_dir))
    line = error_line(err)
    assert code == 2 and "data.prompts_path: the checkpoint's data set had 22 prompts, 20 are loaded" in line, line
    path.write_text("\n".join(GOOD + long_prompts) + "\n")
    assert checkpoints(run_dir) == [(0, True)]

    code, err = cli("resume", str(run_dir), "grpo.reward_function_path=spillover.rollout.builtin.toy_task.reward")
    assert code == 0, err[-3000:]
    done = rows(run_dir)
    assert [r["iteration"] for r in done] == [0, 1, 2]
    assert sorted(g for r in done for g in r["trained_stream_ids"]) == list(range(12))
    assert checkpoints(run_dir) == [(1, True), (2, True)]

    victim = next((run_dir / "checkpoints" / "ckpt-00000002" / "tensors").iterdir())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    victim.write_bytes(bytes(data))
    # the run had finished: a plain resume has nothing to do; trained longer, it finds the newest checkpoint corrupt
    code, err, records = with_records("spillover.checkpoint", cli, "resume", str(run_dir), "schedule.num_iterations=4")
    assert code == 0, err[-3000:]
    warned = [r.getMessage() for r in records if "unusable" in r.getMessage()]
    assert warned and "ckpt-00000002" in warned[0] and "corrupt" in warned[0]
    again = rows(run_dir)
    assert [r["iteration"] for r in again] == [0, 1, 2, 3]  # iteration 2 redone from checkpoint 1, then 3
    assert sorted(g for r in again for g in r["trained_stream_ids"]) == list(range(16))
    assert checkpoints(run_dir) == [(2, True), (3, True)]
