"""Reward models as real Ray actors (grpo.reward_models) on a tiny random Qwen2 sequence classifier: the same text
gets the same score in any batch, and scores combine with the rule reward by their weights."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from spillover.infra.config.scoring import RewardModelConfig


def build_classifier(folder, num_labels: int = 1, seed: int = 0):
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from spillover.infra.models import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=num_labels,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return build_classifier(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def starts(ray_session, classifier, tmp_path_factory):
    """This module's two start_reward_models calls, run at once (every actor is a new process that imports
    torch and transformers): the models the tests score with, and a num_labels=2 folder that must be refused."""
    from spillover.rollout.scoring.reward_models import start_reward_models

    two_labels = build_classifier(tmp_path_factory.mktemp("two"), num_labels=2)
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(start_reward_models, [RewardModelConfig(path=two_labels)])
        models = pool.submit(start_reward_models, [
            RewardModelConfig(path=classifier, weight=0.5, name="a", batch_size=3),
            RewardModelConfig(path=classifier, weight=-2.0, batch_size=2)])
    yield models, refused
    for started in (models, refused):  # refused, unless the check under test is broken
        if started.exception() is None:
            started.result().shutdown()


@pytest.fixture(scope="module")
def models(starts):
    return starts[0].result()


TEXTS = ["1+1=2", "what is 3*4? 12", "a", "a much longer text than the others, padded less", "1+1=2"]


def test_same_text_same_score_in_any_batch(models):
    import ray

    actor = models.actors[0]
    together = ray.get(actor.score.remote(TEXTS))
    alone = [ray.get(actor.score.remote([t]))[0] for t in TEXTS]
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5)  # other padding, other batch
    assert together[0] == pytest.approx(together[4], abs=1e-5)  # TEXTS[4] is TEXTS[0], in another batch
    assert ray.get(actor.score.remote(TEXTS)) == together  # the same call, bit for bit
    assert len(set(np.round(together[:4], 6))) == 4  # a random model still tells texts apart


def test_weights_combine(models):
    import ray

    raw = np.asarray(ray.get(models.actors[0].score.remote(TEXTS)))
    total, metrics = models.score(TEXTS)
    np.testing.assert_allclose(total, 0.5 * raw - 2.0 * raw, atol=1e-5)
    assert set(metrics) == {"reward_model_a_mean", "reward_model_1_mean"}
    assert metrics["reward_model_a_mean"] == pytest.approx(raw.mean(), abs=1e-6)


def test_compute_reward_adds_the_weighted_scores_to_the_rule_reward(models):
    import ray

    from spillover.infra.models import build_char_tokenizer
    from spillover.bench.batches import from_sequences
    from spillover.tasks.results import Rollout
    from spillover.tasks.reward import RewardSetup, compute_reward, response_texts

    tok = build_char_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt, responses = ids("1+1="), [ids("2"), ids("3"), ids("22"), ids("2")]
    batch = from_sequences([prompt + r for r in responses], [len(r) for r in responses],
                           [[-1.0] * len(r) for r in responses], [[0] * len(r) for r in responses], n=4,
                           labels=["2"])
    setup = RewardSetup(tok, (1,), lambda response, label: float(response == label), "exact", rule_weight=3.0,
                        prompt_texts=lambda group_ids: ["1+1="] * len(group_ids), reward_models=models)
    scored = compute_reward.fn(Rollout(batch=batch), setup)
    texts = response_texts(batch, tok, (1,))
    model_part, _ = models.score(["1+1=" + t for t in texts])
    expected = 3.0 * np.array([1.0, 0.0, 0.0, 1.0]) + model_part
    assert scored.metrics["reward_mean"] == pytest.approx(expected.mean(), abs=1e-6)
    advantages = ray.get(scored.batch_ref).advantages
    assert np.argmax(advantages) in (0, 3) and advantages[0] == pytest.approx(advantages[3], abs=1e-6)


def test_a_folder_that_is_not_a_reward_model_is_refused(starts):
    from spillover.rollout.scoring.reward_models import RewardModelError

    with pytest.raises(RewardModelError, match=r"num_labels=2; a reward model needs num_labels=1"):
        starts[1].result()  # start_reward_models on the num_labels=2 folder
