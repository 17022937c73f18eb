"""Kill -9 inside a tool call, then resume (issue 15): `spillover train --config configs/tiny-tools.yaml` (small, with
a calculator that takes 0.6 s per step and more stop strings, so that the end of iteration 0 cuts rows with their call
pending) SIGKILLs itself inside the first calculator step of iteration 1 -- a call pending since checkpoint 0, asked
again -- (kill point "tool_step", rollout/tools/env_pool.py, through the kill_hook test plugin), and `resume` (in process, on
the session's warm parts) finishes the run from checkpoint 0, whose dock holds multi-turn trajectories mid-way.
Sampling is seeded (rollout.deterministic_sampling), so the rows cut with a call pending do not depend on chance:
unseeded, the last round before the cut usually stopped 2-3 rows at a tool call and, once in a loaded suite, none.
Nothing is compared with a reference run.
Every prompt group is trained exactly once, and every trained trajectory is intact: each tool output in it is the
calculator's answer to the action before it, once, in order (a lost or repeated tool call, or a replay that went wrong,
would show). The subprocess joins the session's Ray cluster (as test_kill_resume's joined runs): its own processes
must all be gone, and so must every actor it created (the helpers and leftover checks of
tests/spillover_runs.py)."""
from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest
from background_ray import actors_of
from small_run import SMALL_RUN
from spillover_runs import ROUTER, assert_joined_runs_left_nothing, metrics_rows

from spillover.rollout.builtin.calculator import CalculatorEnv
from spillover.rollout.tools.env import observation_tokens, split_actions

ITERATIONS = 2


class SlowCalculator(CalculatorEnv):
    async def step(self, action_text: str):
        # long against the tiny model's generation, even on a loaded machine: calls are pending at the cut
        await asyncio.sleep(0.6)
        return await super().step(action_text)


def tools_args(run_dir) -> list[str]:
    return ["train", "--config", "configs/tiny-tools.yaml", f"run_dir={run_dir}",
            f"schedule.num_iterations={ITERATIONS}", *SMALL_RUN, "rollout.env_path=test_tool_kill_resume.SlowCalculator",
            "rollout.max_tool_output_tokens=6", "rollout.tool_call_stop=['=', '+', '*']", "tracking.wandb_mode=disabled",
            "tracking.progress=false", "tracking.report=false",
            "engines.rollout_num_gpus=1", "rollout.deterministic_sampling=true",
            f"storage.save_debug_rollout_data={run_dir}/debug/rollout_{{rollout_id}}.parquet"]


def observation_segments(tokens: list[int], mask: list[int]) -> list[list[int]]:
    segments, current = [], []
    for token, m in zip(tokens, mask):
        if m == 0:
            current.append(token)
        elif current:
            segments, current = segments + [current], []
    return segments + ([current] if current else [])


def assert_trajectory_intact(sample, tokenizer, stops: list[str], cap: int, max_tokens: int) -> None:
    mask = sample.loss_mask or [1] * sample.response_length
    actions = split_actions(np.array(sample.response_tokens), np.array(mask), stops, tokenizer.decode)
    segments = observation_segments(sample.response_tokens, mask)
    assert sample.metadata.get("turns", 0) == len(segments), (sample.index, sample.metadata)
    assert len(actions) - len(segments) in (0, 1), (len(actions), len(segments))  # the last: cut by max_turns
    env = CalculatorEnv()
    for i, segment in enumerate(segments):
        want = observation_tokens(asyncio.run(env.step(actions[i])).observation, tokenizer, cap)
        at_budget = i == len(segments) - 1 and sample.response_length == max_tokens
        assert segment == want or (at_budget and want[:len(segment)] == segment), (sample.index, i)


@pytest.mark.timeout(400)
def test_kill_9_inside_a_tool_call_then_resume(spillover, prefect_harness, ray_session, warm_parts,
                                               tmp_path):
    from spillover.infra.config.run_config import load_run_config
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.models import load_tokenizer
    from spillover.infra.storage.store import open_store
    from spillover.rollout.debug_data import load_debug_rollout_data
    from spillover.rollout.context import restore_dock_and_cursor

    run_dir = tmp_path / "tools"
    ray_address = ray_session.get_runtime_context().gcs_address  # it joins the session's cluster: no Ray start
    killed = spillover.run(tools_args(run_dir), SPILLOVER_KILL_AT="tool_step:1", RAY_ADDRESS=ray_address)
    assert killed.returncode == -signal.SIGKILL, spillover.output(killed)
    assert killed.saw(ROUTER)
    saved = load_latest_checkpoint(open_store(str(run_dir / "checkpoints")))
    assert saved.iteration == 0
    dock, _ = restore_dock_and_cursor(saved)
    assert dock.turns.sum() > 0  # the checkpoint holds trajectories with tool turns, carried mid-way
    pending = int(dock.awaiting_tool.sum())  # rows cut with a tool call pending: asked again after the kill
    assert pending >= 1, pending

    cfg = load_run_config(run_dir, ["engines.rollout_num_gpus=2"])  # the warm parts of the suite's small runs
    grpo_train(cfg, resume=True, parts=warm_parts)
    spillover.check_gone(killed)
    # Ray ended the killed driver's job: its engine and learner actors are gone (only its own: other tests' runs
    # join the same cluster; a job is told apart by its driver's pid, the run's session id)
    assert_joined_runs_left_nothing(lambda: actors_of({killed.session}))
    rows = metrics_rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    trained = [g for r in rows for g in r["trained_stream_ids"]]
    assert sorted(trained) == list(range(ITERATIONS * cfg.rollout.global_batch_size))  # each group once
    assert sum(r["tool_calls"] for r in rows) > 0
    for key in ("turns_mean", "tool_calls", "tool_token_share", "carried_mid_tool"):  # issue 15's metrics.jsonl keys
        assert all(key in r for r in rows), key
    assert 0 < max(r["tool_token_share"] for r in rows) < 1 and max(r["turns_mean"] for r in rows) > 1
    rebuilt = rows[1]["tool_env_rebuilds"]
    assert rebuilt >= pending  # a new process: every pending call rebuilt its env (reset + replay)
    print(f"checkpoint 0: {pending} rows awaiting a tool; resumed iteration 1 rebuilt {rebuilt} envs")
    tokenizer = load_tokenizer(run_dir / "tiny_model")
    template = cfg.storage.save_debug_rollout_data
    for iteration in range(ITERATIONS):
        for group in load_debug_rollout_data(template, iteration):
            for sample in group:
                assert_trajectory_intact(sample, tokenizer, cfg.rollout.tool_call_stop,
                                         cfg.rollout.max_tool_output_tokens, cfg.rollout.max_tokens)
