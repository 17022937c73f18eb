"""The pure functions under the Prefect tasks, tested without Prefect, Ray or engines."""
import math

import numpy as np
import pytest

from infra.imports import ImportPathError, load_function
from rollout.data_source import PromptCursor, PromptSet
from rollout.dock import TransferDock
from rollout.sample import Sample
from tasks.logprob import needs_old_logprob_pass
from tasks.prompts import groups_for_iteration, load_prompt_groups
from tasks.reward import RewardError, build_train_batch, score_samples


def sample(i, response="aa", label=2, group=0):
    s = Sample(group_index=group, index=i, prompt_tokens=[3, 4], label=label, prompt="a*2=")
    s.append_segment([14] * len(response), [-0.5] * len(response), 0)
    s.response = response
    return s


def test_score_samples_calls_the_rule_per_sample():
    from rollout.toy_task import reward

    out = score_samples([sample(0, "aa"), sample(1, "a")], reward, "rollout.toy_task.reward")
    assert out.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("fn, match", [
    (lambda response, label, **_: float("nan"), r"returned nan for sample 1 \(group 0"),
    (lambda response, label, **_: "0.5", r"returned '0.5' for sample 0"),
    (lambda response, label, **_: 1 / 0, r"raised on sample 0 .*ZeroDivisionError"),
])
def test_bad_rewards_name_sample_and_function(fn, match):
    if "nan" in match:
        inner = fn
        fn = lambda response, label, sample=None: 1.0 if sample.index == 0 else inner(response, label)  # noqa: E731
    with pytest.raises(RewardError, match=match) as err:
        score_samples([sample(0), sample(1)], fn, "my.rewards.fn")
    assert "my.rewards.fn" in str(err.value)


def test_batched_reward_function():
    def fn(responses, labels, samples=None):
        return [len(r) for r in responses]
    fn.batched = True
    assert score_samples([sample(0, "aaa"), sample(1, "a")], fn, "x.y").tolist() == [3.0, 1.0]


def test_train_batch_gets_group_normalised_advantages():
    groups = [[sample(0), sample(1)], [sample(2, group=1), sample(3, group=1)]]
    batch, adv = build_train_batch(groups, np.array([1.0, 0.0, 0.5, 0.5]))
    assert adv[1].tolist() == [0.0, 0.0]  # all-equal group: no signal, no division by zero
    assert adv[0, 0] > 0 > adv[0, 1] and math.isclose(adv[0, 0], -adv[0, 1], rel_tol=1e-5)
    assert batch.tokens[0] == [3, 4, 14, 14] and batch.rollout_logprobs[0] == [-0.5, -0.5]


@pytest.mark.parametrize("path, match", [
    ("nodots", "not an import path"),
    ("no_such_pkg.fn", "cannot import module 'no_such_pkg'"),
    ("rollout.toy_task.nope", "has no function 'nope'"),
    ("rollout.toy_task.make_prompt", r"must accept \(response, label\)"),
])
def test_wrong_import_paths_fail_with_the_setting(path, match):
    with pytest.raises(ImportPathError, match=match) as err:
        load_function(path, "grpo.reward_function_path", ("response", "label"))
    assert "grpo.reward_function_path" in str(err.value)


def make_dock(gbs=2, n=2, max_split=2):
    return TransferDock(gbs, n, max_split, max_tokens=8, max_model_len=16, eos_token_ids=[1])


def test_load_is_idempotent_per_iteration_and_totals_match_training():
    dock = make_dock()
    prompts = PromptSet([f"p{i}" for i in range(10)], list(range(10)), [[3, 4]] * 10)
    cursor = PromptCursor(10, seed=0)
    count = groups_for_iteration(dock, 0, num_iterations=3)
    assert count == 4  # 2 x GBS on the first iteration
    assert load_prompt_groups(dock, cursor, prompts, 0, count) == 4
    assert load_prompt_groups(dock, cursor, prompts, 0, count) == 0  # a retry loads nothing twice
    assert cursor.position == 4 and dock.free_group_slots() == 0
    assert groups_for_iteration(dock, 2, num_iterations=3) == 0  # the last iteration drains, loads none
    single = make_dock()
    assert groups_for_iteration(single, 0, num_iterations=1) == 2  # one iteration: GBS, all trained


def test_failed_load_leaves_cursor_unchanged():
    dock = make_dock()
    prompts = PromptSet(["p"], [1], [[]])  # an empty prompt cannot be loaded
    cursor = PromptCursor(1, seed=0)
    with pytest.raises(Exception):
        load_prompt_groups(dock, cursor, prompts, 0, 1)
    assert cursor.position == 0 and cursor.loaded_iterations == []


def test_old_logprob_pass_skipped_only_when_all_tokens_are_current():
    assert not needs_old_logprob_pass([[3, 3], [3]], 3, skip_old_logprob=True)
    assert needs_old_logprob_pass([[2, 3], [3]], 3, skip_old_logprob=True)
    assert needs_old_logprob_pass([[3]], 3, skip_old_logprob=False)
