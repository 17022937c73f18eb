"""Overrides that shrink configs/tiny.yaml to a run of seconds: the tests' shared small config."""
SMALL_RUN = ["rollout.global_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_tokens=16",
             "rollout.max_model_len=32", "rollout.max_split=2", "grpo.micro_batch_size=16",
             "grpo.num_steps_per_rollout=1", "data.num_prompts=64", "engines.max_running_requests=32",
             "model.tiny.num_layers=2", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
             "storage.checkpoint_interval=1",
             "tracking.report=false"]  # the plots cost ~1.5 s a run; tests/unit/test_report.py and the UI test check them


def distinct_ones(response: str, label, **_) -> float:
    """A reward the random tiny model learns within a few iterations: the share of '1' characters in the response
    (grpo.reward_function_path=small_run.distinct_ones; tests/ is on the path of the suite's subprocesses too)."""
    return response.count("1") / max(1, len(response))


def distinct_chars(response: str, label, **_) -> float:
    """A reward that varies within a group (the tiny model never solves the built-in task), so that every update moves
    the weights and a wrong resume would show in them (grpo.reward_function_path=small_run.distinct_chars)."""
    return len(set(response)) / 16.0
