"""The dock's multi-turn columns (rollout/dock/turns.py): per-token loss mask, turns, awaiting_tool, env rewards;
what the batch hands the learner; snapshots with and without them; tool tokens get no gradient."""
from __future__ import annotations

import numpy as np
import pytest

from dock_helpers import load, make_dock, put
from spillover.rollout.dock import turns as dock_turns
from spillover.rollout.dock.transfer_dock import TransferDock


def _tool_turn(dock, row, call_tokens, observation, version=1):
    """One turn of `row` (handed out first): call_tokens from the engine, then the tool's observation."""
    dock.in_flight[row] = True
    dock.put_generation([row], [call_tokens], [[-0.5] * len(call_tokens)], version, [False])
    dock_turns.begin_tool_calls(dock, [row])
    assert row not in dock.take_rows().tolist()  # a row waiting for its tool is not generated
    dock.in_flight[:] = False
    dock_turns.put_observations(dock, np.array([row]), [observation], default_version=9)


def test_tool_tokens_have_mask_zero_logprob_zero_and_the_policy_version():
    dock = make_dock(gbs=1, n=2, max_tokens=12, max_model_len=20, multi_turn=True)
    load(dock, [0, 1])
    _tool_turn(dock, 0, [10, 11, 12], [40, 41], version=3)
    assert dock.turns[0] == 1 and not dock.awaiting_tool[0] and not dock.complete[0]
    rows = dock.take_rows()
    assert 0 in rows.tolist()
    put(dock, rows, 2, eos=True, version=4)
    dock_turns.set_env_rewards(dock, [0], [0.25])
    assert dock.update_ready()
    dock.select_batch()
    batch = dock.rollout_batch()
    first = slice(0, 7)
    assert batch.response_tokens[first].tolist() == [10, 11, 12, 40, 41, 10, 0]
    assert batch.loss_mask[first].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert batch.rollout_logprobs[first].tolist() == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert batch.weight_versions[first].tolist() == [3, 3, 3, 3, 3, 4, 4]
    assert batch.turns.tolist() == [1, 0] and batch.loss_tokens.tolist()[0] == 5
    assert batch.env_rewards[0] == 0.25 and np.isnan(batch.env_rewards[1:]).all()
    samples = batch.sample_groups()
    assert samples[0][0].loss_mask == [1, 1, 1, 0, 0, 1, 1] and samples[0][0].metadata["turns"] == 1
    assert samples[0][0].metadata["tool_spans"] == [[3, 5]] and samples[0][1].metadata["tool_spans"] == []
    assert samples[0][0].metadata["env_reward"] == 0.25 and "env_reward" not in samples[0][1].metadata
    dock.clear()
    assert dock.turns.sum() == 0 and not dock.awaiting_tool.any() and np.isnan(dock.env_reward).all()


def test_single_turn_batches_are_unchanged():
    dock = make_dock(gbs=1, n=2)
    assert "mask" not in dock.responses.columns  # a single-turn dock pays nothing for multi-turn state
    load(dock, [0])
    dock.take_rows()
    put(dock, [0, 1], 3, eos=True)
    dock.select_batch()
    batch = dock.rollout_batch()
    assert batch.loss_mask.tolist() == [1] * 6 and batch.turns is None and batch.env_rewards is None
    assert "turns" not in batch.sample_groups()[0][0].metadata


def test_observation_that_fills_the_budget_completes_the_row():
    dock = make_dock(gbs=1, n=2, max_tokens=6, max_model_len=20, multi_turn=True)
    load(dock, [0])
    dock.in_flight[0] = True
    dock.put_generation([0], [[10, 11, 12]], [[-1.0] * 3], 0, [False])
    dock_turns.begin_tool_calls(dock, [0])
    appended = dock_turns.put_observations(dock, np.array([0]), [[40] * 10], default_version=0)
    assert appended.tolist() == [3] and dock.complete[0] and not dock.stopped[0] and not dock.awaiting_tool[0]


def test_snapshot_carries_turn_state_and_a_single_turn_snapshot_resumes_with_tools():
    dock = make_dock(gbs=1, n=2, max_tokens=12, max_model_len=20, multi_turn=True)
    load(dock, [0, 1])
    _tool_turn(dock, 0, [10, 11], [40], version=2)
    dock.in_flight[1] = True
    dock.put_generation([1], [[10, 12]], [[-1.0, -1.0]], 2, [False])
    dock_turns.begin_tool_calls(dock, [1])  # cut with its tool call pending
    dock_turns.set_env_rewards(dock, [0], [1.5])
    arrays, meta = dock.snapshot()
    back = TransferDock.restore(arrays, meta, "a snapshot in memory")
    assert dock_turns.trajectory(back, 0)[1].tolist() == [1, 1, 0]
    assert back.turns[:2].tolist() == [1, 1] and back.awaiting_tool[:2].tolist() == [False, True]
    assert back.env_reward[0] == 1.5 and 1 not in back.take_rows().tolist()
    with pytest.raises(ValueError, match=r"arrays \['turns'\] missing"):
        TransferDock.restore({k: v for k, v in arrays.items() if k != "turns"}, meta, "m")
    old = {k: v for k, v in arrays.items() if k not in ("response_mask", "turns", "awaiting_tool", "env_reward")}
    old_meta = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "multi_turn"}}
    legacy = TransferDock.restore(old, old_meta, "m")  # what a single-turn run's checkpoint holds
    assert not legacy.multi_turn and (dock_turns.trajectory(legacy, 0)[1] == 1).all() and legacy.turns.sum() == 0
    assert not legacy.awaiting_tool.any() and np.isnan(legacy.env_reward).all()
    dock_turns.enable(legacy)  # resumed with rollout.env_path set
    _tool_turn(legacy, 1 * 2, [10], [40])
    assert dock_turns.trajectory(legacy, 0)[1].tolist() == [1, 1, 1]
    assert dock_turns.trajectory(legacy, 2)[1].tolist() == [1, 0]


def test_tool_tokens_never_get_gradient(tiny_model_dir):
    """One update on a batch whose trajectories end in tool tokens: changing those tool tokens changes nothing
    (they are no model input before any trained token), while the same change on policy tokens does -- so the
    test fails if tool tokens reach the loss."""
    import torch

    from spillover.infra.config.training import GRPOConfig, OptimizerConfig
    from spillover.tasks.learner.actor import LearnerActor

    def batch(tail, tail_mask):
        dock = make_dock(gbs=1, n=2, max_tokens=12, max_model_len=20, multi_turn=True)
        dock.load_groups([0], [[3, 4, 12]], ["x"])  # ids inside the tiny model's vocabulary
        dock.take_rows()
        dock.put_generation([0, 1], [[5, 6, 7], [8, 9, 10, 11]], [[-2.0] * 3, [-2.5] * 4], 0, [False, False])
        dock_turns.begin_tool_calls(dock, [0, 1])
        dock_turns.put_observations(dock, np.array([0, 1]), [tail, tail], default_version=0)
        dock.responses.columns["mask"][dock.responses.index(np.array([0, 1]))] = np.concatenate(
            [[1] * 3 + [tail_mask] * len(tail), [1] * 4 + [tail_mask] * len(tail)])
        dock_turns.end_episodes(dock, [0, 1], stopped=True)
        dock.select_batch()
        return dock.rollout_batch().with_advantages(np.array([1.0, -1.0]))

    learner = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=2, off_policy="none"), OptimizerConfig(lr=1e-2),
                           temperature=1.0, seed=0, trainable=True)
    start = learner.get_state()

    def weights_after(b):
        learner.set_state(*start)
        learner.update(b)
        return {k: v.clone() for k, v in learner.net.state_dict().items()}

    a, b = weights_after(batch([20, 21], 0)), weights_after(batch([30, 31], 0))
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, b = weights_after(batch([20, 21], 1)), weights_after(batch([30, 31], 1))
    assert not all(torch.equal(a[k], b[k]) for k in a)
