"""Reward functions get data.additional_keys as `metadata` (sync, batched, async) and async ones are awaited
concurrently within grpo.reward_concurrency; stop strings reach the request payload."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from spillover.infra.models import build_char_tokenizer
from spillover.bench.batches import from_sequences
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.scoring.rule_reward import RewardError, score_responses
from spillover.tasks.reward import RewardSetup, response_texts, score_batch


def dock_batch(metadata):
    dock = TransferDock(gbs=2, n=2, max_split=1, max_tokens=4, max_model_len=16, eos_token_ids=[1])
    dock.load_groups([0, 1], [[3, 4], [5, 6]], ["3", "4"], metadata)
    rows = dock.take_rows()
    dock.put_generation(rows, [[7, 1]] * 4, [[-0.1, -0.1]] * 4, 0, [True] * 4)
    dock.select_batch()
    return dock.rollout_batch()


def test_metadata_reaches_the_reward_function_through_score_batch():
    seen = []

    def reward(response, label, metadata):
        seen.append((label, metadata))
        return float(metadata["level"])

    tok = build_char_tokenizer()
    batch = dock_batch([{"level": 1}, {"level": 5}])
    setup = RewardSetup(tok, (1,), reward, "tests.reward")
    rewards = score_batch(batch, response_texts(batch, tok, (1,)), setup)
    assert rewards.tolist() == [1.0, 1.0, 5.0, 5.0]
    assert seen == [("3", {"level": 1})] * 2 + [("4", {"level": 5})] * 2


def test_metadata_only_for_functions_that_name_it_and_batched_get_a_list():
    plain = score_responses(["a", "b"], [1, 2], lambda response, label: label, "f", str, metadata=[{"x": 1}] * 2)
    assert plain.tolist() == [1.0, 2.0]

    def batched(responses, labels, metadata):
        return [m["x"] for m in metadata]
    batched.batched = True
    assert score_responses(["a", "b"], [1, 2], batched, "f", str, metadata=[{"x": 3}, {"x": 4}]).tolist() == [3, 4]
    none = score_responses(["a"], [1], lambda response, label, metadata: float(metadata is None), "f", str)
    assert none.tolist() == [1.0]  # a run without data.additional_keys passes None


def test_async_reward_functions_run_concurrently_within_the_bound():
    running, peak = 0, 0

    async def reward(response, label, metadata=None):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return len(response) + label

    out = score_responses(["a" * i for i in range(20)], [1] * 20, reward, "f", str, concurrency=4)
    assert out.tolist() == [i + 1.0 for i in range(20)] and peak == 4

    async def inside_a_loop():  # a caller that already runs an event loop (the call moves to a helper thread)
        return score_responses(["ab"], [0], reward, "f", str)
    assert asyncio.run(inside_a_loop()).tolist() == [2.0]

    async def broken(response, label):
        raise KeyError("verifier down")
    with pytest.raises(RewardError, match=r"reward function 'f' raised on response 0: KeyError: 'verifier down'"):
        score_responses(["a", "b"], [1, 2], broken, "f", lambda i: f"response {i}")


def test_rollout_stop_strings_go_into_the_requests():
    from spillover.infra.config.rollout import RolloutConfig
    from spillover.rollout.drivers.requests import SamplingSettings, build_requests

    cfg = RolloutConfig(stop=["</answer>", "\n\n"])
    requests = build_requests([[3, 4]], np.array([8]), SamplingSettings.from_rollout(cfg, (1,)))
    assert requests[0].sampling_params.stop == ["</answer>", "\n\n"]
    assert "stop" not in build_requests([[3]], np.array([8]), SamplingSettings())[0].body()["sampling_params"]
    with pytest.raises(ValueError, match="rollout.stop holds an empty string"):
        RolloutConfig(stop=[""])


def test_from_sequences_batches_have_no_metadata():
    batch = from_sequences([[3, 4, 5], [3, 4, 6]], [1, 1], [[0.0], [0.0]], [[0], [0]], n=2)
    assert batch.metadata == ()
