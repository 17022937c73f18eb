"""A refusal at run time reads like one at start-up, through a real `spillover` process: a reward function that
raises mid-run prints where in the user's own code it failed (once), then the one `spillover:` line naming the
function, the sample and the fix, exit 2; Prefect's task and flow tracebacks stay in the UI (and under --verbose)."""
from __future__ import annotations

import os
import textwrap

REWARD = textwrap.dedent('''
    def reward(response, label, **_):
        return scaled(len(response))


    def scaled(n):
        return n / 0
''')


def test_a_reward_that_raises_prints_the_users_frames_once_and_one_line(spillover, ray_session, tmp_path):
    (tmp_path / "user_code").mkdir()
    (tmp_path / "user_code" / "my_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    run = spillover.run(["train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", "schedule.num_iterations=1",
                         "rollout.global_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_tokens=8",
                         "rollout.max_model_len=24", "grpo.num_steps_per_rollout=1", "grpo.micro_batch_size=16",
                         "data.num_prompts=16", "model.tiny.num_layers=2", "model.tiny.hidden_size=64",
                         "model.tiny.intermediate_size=128", "tracking.wandb_mode=disabled",
                         "tracking.progress=false", "tracking.report=false",
                         "grpo.reward_function_path=my_reward.reward"],
                        RAY_ADDRESS=ray_session.get_runtime_context().gcs_address,
                        PYTHONPATH=os.pathsep.join([str(tmp_path / "user_code"), spillover.env()["PYTHONPATH"]]))
    out = spillover.output(run)
    assert run.returncode == 2, out
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("spillover: ")] == [lines[-1]], out
    assert "RewardError: reward function 'my_reward.reward' raised on sample" in lines[-1]
    assert "ZeroDivisionError" in lines[-1] and "spillover resume" in lines[-1]
    assert out.count("my_reward.py") == 2 and out.count("in scaled") == 1 and out.count("return n / 0") == 1, out
    assert "Traceback of your code" in out and "Traceback (most recent call last)" not in out, out
    assert not any(name in out for name in ("prefect.task_runs", "prefect.flow_runs", "rule_reward.py")), out
