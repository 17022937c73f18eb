"""The learner on the tiny model: as Ray actors (real Ray), and in-process for determinism and the sign of
the update."""
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from spillover.infra.config.run_config import build_config
from spillover.infra.config.training import GRPOConfig, OptimizerConfig
from spillover.bench.reference_lm import load_causal_lm
from learner_batches import random_batch
from batch_views import select_groups
from spillover.bench.batches import row_sequence
from spillover.rollout.batch import split
from spillover.tasks.learner.actor import LearnerActor
from spillover.tasks.learner.group import create_learners
from spillover.tasks.logprob import needs_old_logprob_pass
from spillover.tasks.learner.offpolicy_metrics import SCALAR_KEYS
from spillover.tasks.update import LOGGED


def hf_logprobs(model, tokens: list[int], resp: int, temperature: float) -> np.ndarray:
    """Reference: one unpadded sequence through the HF model."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0] / temperature
    logp = torch.log_softmax(logits, -1)[len(tokens) - resp - 1:len(tokens) - 1]
    return logp.gather(-1, torch.tensor(tokens[len(tokens) - resp:]).unsqueeze(-1)).squeeze(-1).numpy()


@pytest.fixture(scope="module")
def learners(tiny_model_dir, ray_session):
    cfg = build_config(overrides=["grpo.kl_coef=0.05", "grpo.micro_batch_size=4", "rollout.global_batch_size=2",
                                  "rollout.n_samples_per_prompt=4", "rollout.temperature=0.7",
                                  "learner.reference_placement=separate"])  # a reference group of its own
    policy, ref = create_learners(tiny_model_dir, cfg)
    yield policy, ref
    for group in (policy, ref):
        group.shutdown()


def test_actors_logprobs_update_and_weights(learners, tiny_model_dir, ray_session, tmp_path):
    ray = ray_session
    policy, ref = learners
    batch = random_batch(0)
    old_flat, ref_flat = ray.get([policy.compute_logprobs.remote(batch), ref.compute_logprobs.remote(batch)])
    old, ref_lp = split(old_flat, batch.response_lengths), split(ref_flat, batch.response_lengths)
    model = load_causal_lm(tiny_model_dir)
    for i in range(len(batch)):  # micro-batched + padded == each sequence alone, at the sampler's temperature
        expect = hf_logprobs(model, row_sequence(batch, i).tolist(), batch.response_lengths[i], 0.7)
        np.testing.assert_allclose(old[i], expect, atol=1e-5)
        np.testing.assert_array_equal(old[i], ref_lp[i])

    metrics = ray.get(policy.update.remote(batch, old_flat, ref_flat))
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm", "tis_weight_mean", "tis_weight_max",
                "stale_token_share", "entropy"):
        assert np.isfinite(metrics[key]), key
    assert metrics["old_logprob_source"] == "given" and metrics["weight_version"] == 1
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the step
    assert 0 < metrics["tis_weight_mean"] <= 2.0 and metrics["tis_weight_max"] <= 2.0
    assert ray.get(policy.weight_version.remote()) == 1 and ray.get(ref.weight_version.remote()) == 0

    new, ref_after = (split(v, batch.response_lengths) for v in
                      ray.get([policy.compute_logprobs.remote(batch), ref.compute_logprobs.remote(batch)]))
    assert max(np.abs(a - b).max() for a, b in zip(new, old)) > 1e-5  # the policy moved
    for a, b in zip(ref_after, ref_lp):  # the reference did not
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ray.exceptions.RayTaskError, match="frozen reference"):
        ray.get(ref.update.remote(batch, old_flat, ref_flat))

    # weights out: object-store dict and an HF folder both reproduce the policy's logprobs
    weights = ray.get(policy.state_dict_ref.remote())
    model.load_state_dict(weights)
    np.testing.assert_allclose(hf_logprobs(model, row_sequence(batch, 0).tolist(), batch.response_lengths[0], 0.7), new[0], atol=1e-5)
    folder = ray.get(policy.save_weights.remote(str(tmp_path / "w1")))
    reloaded = load_causal_lm(folder)
    np.testing.assert_allclose(hf_logprobs(reloaded, row_sequence(batch, 1).tolist(), batch.response_lengths[1], 0.7), new[1],
                               atol=1e-5)


def test_old_logprob_source_and_stale_share(learners, ray_session):
    ray = ray_session
    policy, ref = learners
    version = ray.get(policy.weight_version.remote())
    fresh = random_batch(1, version=version)
    ref_lp, learner_lp = ray.get([ref.compute_logprobs.remote(fresh), policy.compute_logprobs.remote(fresh)])
    m = ray.get(policy.update.remote(fresh, None, ref_lp))
    assert m["old_logprob_source"] == "rollout" and m["stale_token_share"] == 0.0
    assert m["tis_weight_mean"] == pytest.approx(1.0)  # old == rollout -> weight 1
    # the mismatch still measured, from the update's own forward pass under the same weights
    log_ratio = learner_lp.astype(np.float64) - fresh.rollout_logprobs
    assert m["logprob_mismatch_tokens"] == len(log_ratio) and m["token_staleness_max"] == 0
    assert m["logprob_mismatch_kl"] == pytest.approx(np.mean(np.exp(log_ratio) - log_ratio - 1), rel=1e-4)

    stale = random_batch(2, version=version)  # generated before that update: every token is one version old
    assert needs_old_logprob_pass((version, version), version + 1, skip_old_logprob=True)  # the caller decides
    old = ray.get(policy.compute_logprobs.remote(stale))
    m = ray.get(policy.update.remote(stale, old, ray.get(ref.compute_logprobs.remote(stale))))
    assert m["old_logprob_source"] == "given" and m["stale_token_share"] == 1.0
    with pytest.raises(ray.exceptions.RayTaskError, match="needs ref_logprobs"):
        ray.get(policy.update.remote(stale, None, None))


def test_off_policy_metrics_of_an_update_in_the_actor(learners, ray_session):
    """The update's off-policy metrics, in the Ray actor, on a batch whose versions are set by hand: the longest
    sample was started two versions ago and continued one version ago (a partial rollout), the rest are current."""
    ray = ray_session
    policy, ref = learners
    while (version := ray.get(policy.weight_version.remote())) < 2:
        ray.get(policy.update.remote(random_batch(60 + version, version=version), None,
                                     ray.get(ref.compute_logprobs.remote(random_batch(60 + version, version=version)))))
    batch = random_batch(50, version=version)
    versions = batch.weight_versions.copy()
    longest = int(np.argmax(batch.response_lengths))
    start = int(batch.response_offsets[longest])
    versions[start:start + 2] = [version - 2, version - 1]
    batch = replace(batch, weight_versions=versions)
    old, ref_lp = ray.get([policy.compute_logprobs.remote(batch), ref.compute_logprobs.remote(batch)])
    m = ray.get(policy.update.remote(batch, old, ref_lp))
    assert m["token_staleness_max"] == 2 and m["version_span_max"] == 2
    assert m["masked_token_share"] == 0.0 and m["rejected_sequence_share"] == 0.0  # grpo.off_policy = tis
    weights = np.exp(old.astype(np.float64) - batch.rollout_logprobs)
    assert m["is_weight_p99"] == pytest.approx(np.percentile(weights, 99), rel=1e-4)
    assert m["is_weight_p50"] <= m["is_weight_p90"] <= m["is_weight_p99"] <= m["is_weight_max"]
    assert sum(m["is_weight_hist"]["counts"]) == len(batch.response_tokens) == m["num_trained_tokens"]
    # mismatch: k3 of the engine's vs the learner's logprobs on the tokens of the current version only
    current = versions == version
    log_ratio = old[current].astype(np.float64) - batch.rollout_logprobs[current]
    assert m["logprob_mismatch_tokens"] == int(current.sum()) == len(versions) - 2
    assert m["logprob_mismatch_kl"] == pytest.approx(np.mean(np.exp(log_ratio) - log_ratio - 1), rel=1e-4)
    assert set(SCALAR_KEYS) | {"is_weight_hist"} <= set(LOGGED) & set(m)  # the update task logs them


def test_masked_is_drops_tokens_and_recomputes_old_logprobs(tiny_model_dir):
    batch = random_batch(70)  # every token from the current weights: skip_old_logprob would take rollout logprobs
    learner = _learner(tiny_model_dir, off_policy="masked_is", tis_cap=1.5)
    old = learner.compute_logprobs(batch)  # the engine's logprobs off by up to e^1 either way:
    shift = np.random.default_rng(71).uniform(-1.0, 1.0, len(old)).astype(np.float32)
    batch = replace(batch, rollout_logprobs=old - shift)
    over_cap = np.exp(old.astype(np.float64) - batch.rollout_logprobs) > 1.5
    assert 0 < over_cap.sum() < len(over_cap)
    # masked IS needs the learner's own old logprobs: the config turns the rollout-logprob shortcut off
    assert not build_config(overrides=["grpo.off_policy=masked_is"]).grpo.skip_old_logprob
    with pytest.raises(ValueError, match="grpo.off_policy=masked_is needs old logprobs"):
        learner.update(batch)  # no silent fallback to the rollout logprobs
    m = learner.update(batch, learner.compute_logprobs(batch))
    assert m["old_logprob_source"] == "given"
    assert m["masked_token_share"] == pytest.approx(over_cap.mean())
    assert m["num_trained_tokens"] == len(over_cap) - over_cap.sum()
    assert m["tis_weight_max"] <= 1.5


def _learner(tiny_model_dir, learner_cfg=None, **grpo):
    return LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=3, **grpo), OptimizerConfig(lr=1e-2),
                        temperature=1.0, seed=0, trainable=True, learner_cfg=learner_cfg)


@pytest.mark.parametrize("budget", [None, 40], ids=["count", "token_budget_packed"])
def test_resume_from_state_equals_uninterrupted(tiny_model_dir, tmp_path, budget):
    from spillover.infra.config.learner import LearnerConfig

    lcfg = LearnerConfig(max_tokens_per_micro_batch=budget)
    b1, b2, b3 = random_batch(10), random_batch(11, version=1), random_batch(12, version=2)
    straight = _learner(tiny_model_dir, lcfg)
    straight.update(b1)
    tensors, meta = straight.get_state()
    save_file(tensors, tmp_path / "state.safetensors")  # the checkpoint path: safetensors, no pickle
    straight.update(b2)
    straight.update(b3)

    resumed = _learner(tiny_model_dir, lcfg)
    resumed.set_state(load_file(tmp_path / "state.safetensors"), meta)
    assert resumed.weight_version() == 1
    resumed.update(b2)
    resumed.update(b3)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="does not fit"):
        resumed.set_state({"model/nope": torch.zeros(1)}, meta)


def test_a_longer_resumed_run_goes_on_with_the_recorded_lr_decay(tiny_model_dir):
    """The learner records its lr decay span in its state (format 2); the learner of a longer run (4 iterations)
    resumed from a 2-update state goes on from where the decay was, not from a new curve (issue 41 item 2). A format-1
    state (before the span was recorded) is refused as it is, and resumes once given its run's horizon."""
    from spillover.infra.config.training import DecaySpan
    from spillover.tasks.learner.state import STATE_FORMAT, from_format_1

    optim = OptimizerConfig(lr=1e-2, lr_decay="cosine")

    def learner(iterations: int) -> LearnerActor:
        return LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=3), optim, temperature=1.0, seed=0,
                            trainable=True, total_steps=iterations)

    short = learner(2)
    lrs = [short.update(random_batch(10 + k, version=k))["lr"] for k in range(2)]
    tensors, meta = short.get_state()
    assert meta["format"] == STATE_FORMAT == 2
    assert meta["lr_decay"] == {"start_step": 0, "start_progress": 0.0, "end_step": 2}
    longer = learner(4)
    longer.set_state(tensors, meta)
    assert longer.lr_decay == DecaySpan(1, 0.5, 4)  # from update 1 (half the decay done) on to update 4
    lr = longer.update(random_batch(12, version=2))["lr"]
    assert lr == pytest.approx(optim.lr_at(2, DecaySpan(1, 0.5, 4))) and lrs[0] > lrs[1] > lr > optim.lr * 0.1
    assert lr < optim.lr_at(2, optim.fresh_decay(4))  # below where a decay started over at the new horizon was
    format_1 = {**{k: v for k, v in meta.items() if k != "lr_decay"}, "format": 1}
    with pytest.raises(ValueError, match="learner state format 1 is not 2"):
        learner(4).set_state(tensors, format_1)
    upgraded = learner(4)
    upgraded.set_state(tensors, from_format_1(format_1, decay_horizon=2))
    assert upgraded.lr_decay == DecaySpan(1, 0.5, 4)


def test_positive_advantage_raises_its_logprob(tiny_model_dir):
    batch = random_batch(20, n=4, advantages=[1.0, -1.0, 0.0, 0.0])
    for agg in ("token_mean", "seq_mean"):
        learner = _learner(tiny_model_dir, loss_agg=agg, off_policy="none")
        before = split(learner.compute_logprobs(batch), batch.response_lengths)
        for _ in range(3):
            learner.update(batch)
        after = split(learner.compute_logprobs(batch), batch.response_lengths)
        assert after[0].sum() > before[0].sum() and after[1].sum() < before[1].sum(), agg


def test_micro_batch_size_does_not_change_the_step(tiny_model_dir):
    batch = random_batch(30, n=7)
    states = []
    for mbs in (2, 7):
        learner = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=mbs), OptimizerConfig(), 1.0, 0, True)
        metrics = learner.update(batch)
        states.append((metrics["loss"], learner.model.state_dict()))
    assert states[0][0] == pytest.approx(states[1][0], rel=1e-5)
    for k, v in states[0][1].items():
        torch.testing.assert_close(v, states[1][1][k], atol=1e-6, rtol=1e-5)


def _with_grads(learner: LearnerActor) -> list[dict[str, torch.Tensor]]:
    """The gradients each optimizer step of `learner` is given, recorded as it steps."""
    seen, step = [], learner.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({n: p.grad.clone() for n, p in learner.model.named_parameters()})
        return step(*args, **kwargs)

    learner.optimizer.step = recording_step
    return seen


def test_token_budget_packed_rows_equal_padded_count_micro_batches(tiny_model_dir):
    """learner.max_tokens_per_micro_batch (packed rows, and padded rows) == grpo.micro_batch_size padded rows: the
    same logprobs, loss, metrics and gradients (the loss denominators are the step's, whatever the cut); packed
    rows compute no padding."""
    from spillover.infra.config.learner import LearnerConfig

    batch = random_batch(31, n=12, max_response=30)
    runs = {}
    configs = {"count": LearnerConfig(), "padded": LearnerConfig(max_tokens_per_micro_batch=64, pack_sequences=False),
               "packed": LearnerConfig(max_tokens_per_micro_batch=64)}
    for name, lcfg in configs.items():
        learner = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=4, num_steps_per_rollout=2),
                               OptimizerConfig(lr=1e-3), 1.0, 0, True, learner_cfg=lcfg)
        grads = _with_grads(learner)
        old = learner.compute_logprobs(batch)
        runs[name] = (old, learner.update(batch, old), grads)
    want_old, want, want_grads = runs["count"]
    assert want["padding_share"] > 0.1 and runs["packed"][1]["padding_share"] == 0.0
    for name in ("padded", "packed"):
        old, m, grads = runs[name]
        np.testing.assert_allclose(old, want_old, atol=1e-5)
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "tis_weight_mean", "tis_weight_max",
                    "ppo_kl", "num_trained_tokens"):
            assert m[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, key)
        assert len(grads) == len(want_grads) == 2
        for got_step, want_step in zip(grads, want_grads):
            for k, g in want_step.items():
                torch.testing.assert_close(got_step[k], g, atol=1e-6, rtol=1e-4, msg=f"{name} {k}")


def test_steps_per_rollout_equal_successive_steps_on_the_halves(tiny_model_dir):
    """num_steps_per_rollout=2: two AdamW steps, each on half the batch, old logprobs taken once before the
    first, and the lr schedule advancing per step; the weight version advances once."""
    batch = random_batch(40, n=8)
    optim = OptimizerConfig(lr=1e-2, lr_decay="linear", min_lr_ratio=0.5)
    two = LearnerActor(str(tiny_model_dir), GRPOConfig(num_steps_per_rollout=2), optim, 1.0, 0, True, total_steps=4)
    old = two.compute_logprobs(batch)
    metrics = two.update(batch, old_logprobs=old)
    assert metrics["optimizer_steps"] == 2 and metrics["weight_version"] == 1
    assert metrics["lr"] == pytest.approx(optim.lr_at(1, optim.fresh_decay(8)))

    one = LearnerActor(str(tiny_model_dir), GRPOConfig(), optim, 1.0, 0, True, total_steps=8)
    for k, half in enumerate((range(0, 4), range(4, 8))):
        sub = select_groups(batch, list(half))
        starts = batch.response_offsets
        one.update(sub, old_logprobs=np.concatenate([old[starts[i]:starts[i + 1]] for i in half]))
    a, b = two.model.state_dict(), one.model.state_dict()
    moved = max(float((a[k] - load_causal_lm(tiny_model_dir).state_dict()[k]).abs().max()) for k in a)
    assert moved > 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("budget", [None, 4], ids=["count", "token_budget_packed"])
def test_a_micro_batch_with_no_response_token_still_steps(tiny_model_dir, budget):
    """A sample can come back with no response token (a rollout marked it FAILED or ABORTED before its first one);
    a micro-batch of only such rows has nothing to score but must still run backward (every rank's FSDP collectives
    do): the step is finite and trains the other rows."""
    from spillover.bench.batches import from_sequences
    from spillover.infra.config.learner import LearnerConfig

    learner = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=1), OptimizerConfig(lr=1e-2),
                           temperature=1.0, seed=0, trainable=True,
                           learner_cfg=LearnerConfig(max_tokens_per_micro_batch=budget))
    batch = from_sequences([[5, 6, 7], [5, 6, 8, 9, 10]], [0, 2], [[], [-3.0, -3.0]], [[], [0, 0]],
                           advantages=[1.0, -1.0])
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    metrics = learner.update(batch, learner.compute_logprobs(batch))  # ratio 1: the row with tokens has a gradient
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["num_trained_tokens"] == 2
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
