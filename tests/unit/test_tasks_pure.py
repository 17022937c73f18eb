"""The pure functions under the Prefect tasks, tested without Prefect, Ray or engines."""
import math

import numpy as np
import pytest

from spillover.bench.batches import row_sequence
from spillover.infra.imports import ImportPathError, load_function
from spillover.rollout.prompt_data import PromptCursor, PromptSet
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.sample import Sample
from spillover.tasks.logprob import needs_old_logprob_pass
from spillover.tasks.prompts import groups_for_iteration, load_prompt_groups
from spillover.rollout.batch import RolloutBatch
from spillover.rollout.scoring.rule_reward import RewardError, score_samples
from spillover.tasks.reward import RewardSetup, build_advantages, response_texts, score_batch


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from spillover.infra.models import build_char_tokenizer

    return build_char_tokenizer()


def sample(i, response="aa", label=2, group=0):
    s = Sample(group_index=group, index=i, prompt_tokens=[3, 4], label=label, prompt="a*2=")
    s.append_segment([14] * len(response), [-0.5] * len(response), 0)
    s.response = response
    return s


def test_score_samples_calls_the_rule_per_sample():
    from spillover.rollout.builtin.toy_task import reward

    out = score_samples([sample(0, "aa"), sample(1, "a")], reward, "spillover.rollout.builtin.toy_task.reward")
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


def test_batch_gets_group_normalised_advantages():
    groups = [[sample(0), sample(1)], [sample(2, group=1), sample(3, group=1)]]
    batch = RolloutBatch.from_samples(groups)
    adv = build_advantages(batch, np.array([1.0, 0.0, 0.5, 0.5]))
    assert adv[2:].tolist() == [0.0, 0.0]  # all-equal group: no signal, no division by zero
    assert adv[0] > 0 > adv[1] and math.isclose(adv[0], -adv[1], rel_tol=1e-5)
    scored = batch.with_advantages(adv)
    assert row_sequence(scored, 0).tolist() == [3, 4, 14, 14] and scored.rollout_logprobs[:2].tolist() == [-0.5, -0.5]
    sft = RolloutBatch.from_samples([[sample(0)]], sft=True)
    assert build_advantages(sft, np.zeros(1)).tolist() == [1.0]  # SFT: advantage 1, the NLL gradient


def test_score_batch_gives_samples_only_to_functions_that_ask(tiny_tokenizer):
    groups = [[sample(0, "aa"), sample(1, "a")]]
    batch = RolloutBatch.from_samples(groups)
    texts = response_texts(batch, tiny_tokenizer, stop_token_ids=[])
    seen = []
    plain = RewardSetup(tiny_tokenizer, (), lambda response, label, **kw: seen.append(kw) or len(response), "x.plain")
    assert score_batch(batch, texts, plain).tolist() == [len(texts[0]), len(texts[1])] and seen == [{}, {}]
    asks = RewardSetup(tiny_tokenizer, (), lambda response, label, sample=None: float(sample.index), "x.asks")
    assert score_batch(batch, texts, asks).tolist() == [0.0, 1.0]
    with pytest.raises(RewardError, match=r"x.nan.*returned nan for sample 1 \(group 0, prompt 'a\*2='"):
        nan_on_second = lambda response, label: float("nan") if response == texts[1] else 1.0  # noqa: E731
        score_batch(batch, texts, RewardSetup(tiny_tokenizer, (), nan_on_second, "x.nan"))


@pytest.mark.parametrize("path, match", [
    ("nodots", "not an import path"),
    ("no_such_pkg.fn", "cannot import module 'no_such_pkg'"),
    ("spillover.rollout.builtin.toy_task.nope", "has no function 'nope'"),
    ("spillover.rollout.builtin.toy_task.make_prompt", r"must accept \(response, label\)"),
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
    count = groups_for_iteration(dock, num_iterations=3)
    assert count == 4  # 2 x GBS on the first iteration
    assert load_prompt_groups(dock, cursor, prompts, 0, count) == 4
    assert load_prompt_groups(dock, cursor, prompts, 0, count) == 0  # a retry loads nothing twice
    assert cursor.position == 4 and dock.free_group_slots() == 0
    assert groups_for_iteration(dock, num_iterations=3) == 0  # full: nothing fits
    single = make_dock()
    assert groups_for_iteration(single, num_iterations=1) == 2  # one iteration: GBS, all trained


def train_iteration(dock, cursor, prompts, iteration, num_iterations) -> int:
    """One iteration as the flow runs it, every row finishing at once -> the groups loaded."""
    loaded = load_prompt_groups(dock, cursor, prompts, iteration, groups_for_iteration(dock, num_iterations))
    dock.set_drain(iteration == num_iterations - 1)
    rows = np.flatnonzero(dock.occupied_rows())
    dock.in_flight[rows] = True
    dock.put_generation(rows, [[1]] * len(rows), [[-0.5]] * len(rows), iteration, [False] * len(rows))
    assert dock.update_ready()
    dock.select_batch()
    dock.clear()
    return loaded


def test_a_drained_dock_is_filled_to_2_gbs_again_when_the_run_is_extended():
    """`spillover resume RUN schedule.num_iterations=N` after the last iteration drained the dock: the added
    iterations start from 2 x GBS again, as a fresh run does, so that rows can be cut again (issue 41)."""
    dock = make_dock()  # GBS 2, partial rollout: capacity 4
    prompts = PromptSet([f"p{i}" for i in range(20)], list(range(20)), [[3, 4]] * 20)
    cursor = PromptCursor(20, seed=0)
    assert [train_iteration(dock, cursor, prompts, it, 2) for it in range(2)] == [4, 0]
    assert dock.free_group_slots() == 4  # drained
    assert [train_iteration(dock, cursor, prompts, it, 5) for it in range(2, 5)] == [4, 2, 0]
    assert cursor.position == 5 * 2  # each of the 5 x GBS groups loaded once


def test_failed_load_leaves_cursor_unchanged():
    dock = make_dock()
    prompts = PromptSet(["p"], [1], [[]])  # an empty prompt cannot be loaded
    cursor = PromptCursor(1, seed=0)
    with pytest.raises(Exception):
        load_prompt_groups(dock, cursor, prompts, 0, 1)
    assert cursor.position == 0 and cursor.loaded_iterations == []


def test_old_logprob_pass_skipped_only_when_all_tokens_are_current():
    assert not needs_old_logprob_pass((3, 3), 3, skip_old_logprob=True)
    assert needs_old_logprob_pass((2, 3), 3, skip_old_logprob=True)
    assert needs_old_logprob_pass((-1, -1), 3, skip_old_logprob=True)  # SFT tokens: no policy made them
    assert needs_old_logprob_pass((3, 3), 3, skip_old_logprob=False)
