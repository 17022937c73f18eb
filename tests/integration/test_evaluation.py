"""Eval over real engines: the shared `rollout_manager` (two torch engines on the 'varied' tiny model behind
the real sglang-router), the toy task's eval files read like the flow reads them.

The random model scores 0 on the toy reward, so the reward here is the response's length share (it varies),
and '?' (which the model often writes) is a stop token besides EOS, so both ends of a response occur."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx
import pytest

from spillover.infra.models import load_tokenizer
from spillover.rollout.prompt_data import read_prompts
from spillover.rollout.drivers.evaluation import EvalAborted, eval_log_dict, eval_metrics, eval_step, run_eval
from spillover.rollout.sample import Sample, Status
from spillover.rollout.builtin.toy_task import generate_dataset
from waiting import wait_for

MAX_NEW = 10


def reward(response: str, label, **_) -> float:
    return len(response) / MAX_NEW


def stops(tok) -> list[int]:
    return [tok.eos_token_id, tok.convert_tokens_to_ids("?")]


@pytest.fixture(scope="module")
def eval_sets(varied_model_dir, tmp_path_factory):
    tok = load_tokenizer(varied_model_dir)
    folder = tmp_path_factory.mktemp("eval_data")
    sets = {key: read_prompts(generate_dataset(folder / f"{key}.jsonl", count, seed), tok, 16)
            for key, count, seed in (("toy", 6, 1), ("toy_hard", 4, 2))}
    return tok, sets


def evaluate(manager, tok, sets, **kw):
    kw = {"max_new_tokens": MAX_NEW, **kw}
    return run_eval(sets, manager, reward, tokenizer=tok, stop_token_ids=stops(tok), reward_fn_path="length share",
                    **kw)


def test_greedy_eval_scores_every_set_like_the_engine_and_reward_say(rollout_manager, eval_sets):
    tok, sets = eval_sets
    results = evaluate(rollout_manager, tok, sets)
    assert list(results) == ["toy", "toy_hard"]
    stop_ids = stops(tok)
    for key, groups in results.items():
        assert [len(g) for g in groups] == [1] * len(sets[key])
        for g, (group, ids, label) in enumerate(zip(groups, sets[key].tokens, sets[key].labels)):
            s = group[0]
            assert (s.group_index, s.prompt_tokens, s.label) == (g, ids, label)
            assert 0 < s.response_length <= MAX_NEW and s.weight_versions == [0] * s.response_length
            ended_by_length = s.response_length == MAX_NEW and s.response_tokens[-1] not in stop_ids
            assert s.status == (Status.TRUNCATED if ended_by_length else Status.COMPLETED)
            text = tok.decode(s.response_tokens[:-1] if s.response_tokens[-1] in stop_ids else s.response_tokens)
            assert s.response == text and s.reward == reward(text, label)
        metrics = eval_metrics(key, groups)
        flat = [g[0] for g in groups]
        assert metrics[f"eval/{key}"] == pytest.approx(sum(s.reward for s in flat) / len(flat))
        assert metrics[f"eval/{key}-truncated_ratio"] == pytest.approx(
            sum(s.status == Status.TRUNCATED for s in flat) / len(flat))
    statuses = {s.status for g in [*results["toy"], *results["toy_hard"]] for s in g}
    assert statuses == {Status.TRUNCATED, Status.COMPLETED}, "both ends of a response should occur here"
    # Greedy: the same tokens as one engine answering the same prompt directly, and on a second run.
    direct = httpx.post(rollout_manager.urls[0] + "/generate", timeout=30, json={
        "input_ids": sets["toy"].tokens[2], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                                "stop_token_ids": stop_ids}}).json()
    assert results["toy"][2][0].response_tokens == direct["output_ids"]
    again = evaluate(rollout_manager, tok, sets)
    assert [[s.response_tokens for s in g] for g in again["toy_hard"]] == \
           [[s.response_tokens for s in g] for g in results["toy_hard"]]


def test_sampled_eval_gives_groups_of_n_and_a_log_dict(rollout_manager, eval_sets):
    tok, sets = eval_sets
    results = evaluate(rollout_manager, tok, {"toy": sets["toy"]}, temperature=1.0, n_samples_per_prompt=3,
                       max_model_len=12)
    groups = results["toy"]
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2]] * len(sets["toy"])
    assert all(len(s.prompt_tokens) + s.response_length <= 12 for g in groups for s in g)
    log = eval_log_dict(results, eval_step(rollout_id=5, train_step=40, use_train_step=False))
    assert set(log) == {"eval/toy", "eval/toy-truncated_ratio", "eval/step"} and log["eval/step"] == 5


def test_an_abort_during_eval_is_an_error_not_a_metric(rollout_manager, eval_sets):
    tok, sets = eval_sets
    m = rollout_manager

    def generate_then_abort(jobs, on_result=None, detach=False):  # long answers, aborted once both engines are busy
        for job in jobs:
            job.request.sampling_params.ignore_eos = True

        def abort_when_busy():
            wait_for(lambda: [httpx.get(u + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"]
                              for u in m.urls], 20, "both engines running", every=0.02,
                     until=lambda running: all(running))
            m.abort_all()

        aborter = threading.Thread(target=abort_when_busy, daemon=True)
        aborter.start()
        try:
            return m.generate(jobs)
        finally:
            aborter.join(30)  # never let this abort reach a later test's requests

    with pytest.raises(EvalAborted, match="was aborted after"):
        run_eval(sets, SimpleNamespace(generate=generate_then_abort), reward, tokenizer=tok, stop_token_ids=[],
                 max_new_tokens=400)
    assert len(evaluate(m, tok, {"toy": sets["toy"]})["toy"]) == len(sets["toy"])  # the engines run on


def test_metrics_and_step_by_hand():
    def s(reward, status):
        return Sample(0, 0, [1], reward=reward, status=status)

    groups = [[s(1.0, Status.COMPLETED), s(0.0, Status.TRUNCATED)], [s(0.5, Status.COMPLETED), s(0.5, Status.COMPLETED)]]
    assert eval_metrics("math", groups) == {"eval/math": 0.5, "eval/math-truncated_ratio": 0.25}
    assert eval_step(3, 24, use_train_step=True) == 24 and eval_step(3, 24, use_train_step=False) == 3
    with pytest.raises(ValueError, match="'empty' produced no samples"):
        eval_metrics("empty", [])
    with pytest.raises(ValueError, match="has no reward"):
        eval_metrics("unscored", [[Sample(0, 0, [1])]])
