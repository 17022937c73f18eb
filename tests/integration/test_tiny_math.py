"""configs/tiny-math.yaml end to end through `spillover train` and `spillover eval` (in process, the script's
parsing and exit codes): BPE tokenizer with a chat template built into the run dir, chat prompts generated as
Parquet, the math-verify reward, a stop string, additional keys; then pass@1 and pass@k of its checkpoint."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # a 2-iteration run and an eval: ~1 min
SHRINK = ["rollout.global_batch_size=4", "rollout.n_samples_per_prompt=4", "grpo.micro_batch_size=16",
          "grpo.num_steps_per_rollout=1", "data.num_prompts=32", "engines.rollout_num_gpus=1",
          "engines.max_running_requests=32", "tracking.wandb_mode=disabled", "tracking.progress=false"]


def spillover(*argv: str, parts=None) -> tuple[int, str, str]:
    from spillover.flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv), parts)
    return code, out.getvalue(), err.getvalue()


def test_tiny_math_trains_and_evaluates(prefect_harness, warm_parts, tmp_path):
    from spillover.infra.models import load_tokenizer

    run_dir = tmp_path / "tiny-math"
    code, _, err = spillover("train", "--config", "configs/tiny-math.yaml", f"run_dir={run_dir}",
                             "schedule.num_iterations=2", *SHRINK, parts=warm_parts)
    assert code == 0, err[-3000:]
    tok = load_tokenizer(run_dir / "tiny_model")
    spec = json.loads((run_dir / "tiny_model" / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and tok.eos_token == "<|im_end|>" and tok.chat_template
    assert any(len(tok.decode([i])) > 1 for i in tok("What is 12 + 7?", add_special_tokens=False)["input_ids"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and all(0 <= r["reward_mean"] <= 1 for r in rows)
    data = run_dir / "data" / "train.parquet"
    code, out, err = spillover("eval", str(run_dir), "--data", str(data), "eval.k=2", "engines.rollout_num_gpus=1",
                               parts=warm_parts)
    assert code == 0, err[-3000:]
    result = json.loads((run_dir / "eval" / "train.json").read_text())
    assert result["prompts"] == 32 and result["checkpoint_iteration"] == 1 and "pass@2" in result
    assert result["reward_function"] == "spillover.rollout.builtin.math_reward.reward" and "pass@1 (greedy)" in out
