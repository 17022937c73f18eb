"""GRPO loss pieces against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import build_config
from spillover.infra.config.training import GRPOConfig
from spillover.tasks.grpo_loss import (aggregate, behaviour_weights, clipped_policy_loss, geometric_mean_ratio,
                                       group_advantages, kl_penalty, masked_is_weights, off_policy_correction,
                                       sequence_rejection_mask, tis_weights)
from spillover.tasks.learner.token_logprobs import chunked_token_logprobs

T = torch.tensor


# ----- advantages -----
def test_advantages_hand_computed():
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 1.0]])
    np.testing.assert_allclose(adv[0], [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)
    # mean 1, std sqrt((1 + 0 + 1 + 0) / 3) = 0.816497
    np.testing.assert_allclose(adv[1], [-1.224745, 0.0, 1.224745, 0.0], atol=1e-5)
    assert adv.shape == (2, 4) and adv.dtype == np.float32


def test_all_equal_group_gets_zero_advantage_without_nan():
    with np.errstate(all="raise"):  # any division by zero would raise here
        adv = group_advantages([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert np.all(adv[:2] == 0.0) and np.all(np.isfinite(adv))
    assert adv[2, 1] > 0 > adv[2, 0]


def test_advantages_mean_only_and_bad_input():
    np.testing.assert_allclose(group_advantages([[0.0, 1.0, 2.0]], scale_by_std=False), [[-1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="n >= 2"):
        group_advantages([1.0, 2.0])
    with pytest.raises(ValueError, match="group 0 sample 1"):
        group_advantages([[0.0, float("nan")]])


# ----- KL estimators -----
def test_kl_estimators_hand_computed():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    # k3: r = ref - logp = -log 2 -> exp(r) - r - 1 = 0.5 + 0.693147 - 1
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_penalty(logp, logp, "k3").item() == 0.0


def test_low_var_kl_clamps_where_k3_does_not():
    logp, ref = T([0.0]), T([-30.0])
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(29.0, abs=1e-4)
    assert kl_penalty(logp, ref, "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k2")


# ----- TIS -----
def test_tis_weights_truncate_and_detach():
    old = T([-1.0, -2.0, -1.5], requires_grad=True)
    rollout = T([-2.0, -1.0, -1.5])
    w = tis_weights(old, rollout, cap=2.0)
    np.testing.assert_allclose(w.numpy(), [2.0, math.exp(-1.0), 1.0], rtol=1e-6)  # e^1 = 2.718 -> capped at 2
    assert not w.requires_grad
    with pytest.raises(ValueError, match="tis_cap"):
        tis_weights(old, rollout, cap=0.0)


# ----- other off-policy corrections (grpo.off_policy) -----
def test_masked_is_drops_tokens_over_the_cap_from_loss_and_denominator():
    old, rollout = T([[0.0, 0.0, 0.0, 0.0]]), T([[0.0, -1.0, 1.0, -1.0]])  # ratios 1, e, 1/e, e
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    weights, keep = masked_is_weights(old, rollout, mask, cap=2.0)
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0]]  # e > 2 dropped; the last token was never in the loss
    np.testing.assert_allclose(weights.numpy(), [[1.0, 0.0, math.exp(-1.0), 0.0]], rtol=1e-6)  # kept: untruncated
    # token_mean over keep: (1 * 1 + 3 * e^-1) / 2 tokens, not / 3
    loss = aggregate(T([[1.0, 2.0, 3.0, 4.0]]) * weights, keep, "token_mean")
    assert loss.item() == pytest.approx((1.0 + 3.0 * math.exp(-1.0)) / 2, rel=1e-6)


def test_masked_is_drops_a_token_whose_ratio_overflows_without_a_nan():
    """exp(old - rollout) overflows float32 past ~88.7 (an engine logprob near -inf): that token is dropped, and the
    loss stays finite."""
    old, rollout, mask = T([[0.0, 0.0]]), T([[-0.1, -100.0]]), T([[1.0, 1.0]])
    weights, keep = masked_is_weights(old, rollout, mask, cap=2.0)
    assert keep.tolist() == [[1.0, 0.0]] and weights[0, 1].item() == 0.0
    assert math.isfinite(aggregate(T([[1.0, 2.0]]) * weights, keep, "token_mean").item())


def test_geometric_mean_ratio_and_sequence_rejection():
    old = T([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = T([[-0.1, -0.1, -0.1], [0.0, 0.0, 5.0], [-0.3, -0.3, 0.0], [9.0, 9.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # mean log-ratios over the mask: 0.1, -1, 0.3, none (-> ratio 1)
    np.testing.assert_allclose(geometric_mean_ratio(old, rollout, mask).numpy(),
                               [math.exp(0.1), math.exp(-1.0), math.exp(0.3), 1.0], rtol=1e-6)
    keep, rejected = sequence_rejection_mask(old, rollout, mask, low=0.8, high=1.25)
    assert rejected.tolist() == [0.0, 1.0, 1.0, 0.0]  # 1.105 in, 0.368 below, 1.350 above, empty never
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0] * 3, [0.0] * 3, [0.0] * 3]
    with pytest.raises(ValueError, match="seq_reject_low"):
        sequence_rejection_mask(old, rollout, mask, low=1.1, high=1.25)


def test_decoupled_ppo_weights_behaviour_and_clips_against_the_proximal_policy():
    prox, behav = T([[0.0, 0.0, 0.0]]), T([[-0.5, -1.0, 0.2]])  # behaviour weights e^0.5, e^1 (> cap), e^-0.2
    np.testing.assert_allclose(behaviour_weights(prox, behav, cap=2.0).numpy(),
                               [[math.exp(0.5), 0.0, math.exp(-0.2)]], rtol=1e-6)
    logp = (prox + torch.log(T([[1.5, 1.5, 0.9]]))).requires_grad_(True)  # pi / pi_prox = 1.5, 1.5, 0.9
    # the learner's composition: clipped_policy_loss x the "decoupled" correction's weights
    weights, keep = off_policy_correction("decoupled", prox, behav, T([[1.0, 1.0, 1.0]]), cap=2.0)
    plain, clipped = clipped_policy_loss(logp, prox, T([[1.0]]), clip_eps=0.2)
    loss = plain * weights
    # A = 1: ratio 1.5 clipped to 1.2 -> -1.2 * e^0.5; the second token's weight is 0; 0.9 unclipped -> -0.9 e^-0.2
    np.testing.assert_allclose(loss.detach().numpy(), [[-1.2 * math.exp(0.5), 0.0, -0.9 * math.exp(-0.2)]],
                               rtol=1e-6)
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]
    loss.sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[0.0, 0.0, -0.9 * math.exp(-0.2)]], rtol=1e-6)
    assert keep.tolist() == [[1.0, 1.0, 1.0]]  # AReaL: zero-weight tokens stay in the denominator


def test_off_policy_correction_modes():
    old, rollout, mask = T([[0.0, 0.0]]), T([[-1.0, 0.0]]), T([[1.0, 1.0]])  # ratios e, 1; geometric e^0.5
    cases = {"none": ([1.0, 1.0], [1.0, 1.0]), "tis": ([2.0, 1.0], [1.0, 1.0]),
             "masked_is": ([0.0, 1.0], [0.0, 1.0]), "seq_reject": ([1.0, 1.0], [0.0, 0.0]),
             "decoupled": ([0.0, 1.0], [1.0, 1.0])}
    for mode, (weights, keep) in cases.items():
        w, k = off_policy_correction(mode, old, rollout, mask, cap=2.0, low=0.8, high=1.25)
        np.testing.assert_allclose(w.numpy(), [weights], rtol=1e-6, err_msg=mode)
        assert k.tolist() == [keep], mode
    with pytest.raises(ValueError, match="grpo.off_policy"):
        off_policy_correction("icepop", old, rollout, mask, cap=2.0)


def test_off_policy_config():
    assert GRPOConfig().off_policy == "tis" and GRPOConfig().skip_old_logprob  # the default
    assert build_config(overrides=["grpo.off_policy=none"]).grpo.off_policy == "none"
    with pytest.raises(ConfigError, match="grpo.tis"):  # no second spelling of off_policy
        build_config(overrides=["grpo.tis=false"])
    for mode in ("masked_is", "decoupled"):  # they need the learner's own old logprobs
        assert not GRPOConfig(off_policy=mode).skip_old_logprob
        with pytest.raises(ConfigError, match="skip_old_logprob=false"):
            build_config(overrides=[f"grpo.off_policy={mode}", "grpo.skip_old_logprob=true"])
    assert GRPOConfig(off_policy="seq_reject").skip_old_logprob
    cfg = GRPOConfig(off_policy="masked_is")
    assert GRPOConfig.model_validate(cfg.model_dump()) == cfg  # a dumped config (checkpoint, UI) loads back


# ----- policy loss -----
def test_clipped_policy_loss_four_quadrants():
    ratios = T([[1.5, 0.5, 1.5, 0.5]])
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    logp = torch.log(ratios).requires_grad_(True)
    loss, clipped = clipped_policy_loss(logp, torch.zeros_like(logp), adv, clip_eps=0.2)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped); A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.5: max(1.5, 1.2) = 1.5;               A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    np.testing.assert_allclose(loss.detach().numpy(), [[-1.2, -0.5, 1.5, 0.8]], rtol=1e-6)
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    loss.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; 0 where clipped
    np.testing.assert_allclose(logp.grad.numpy(), [[0.0, -0.5, 1.5, 0.0]], rtol=1e-6)


def test_clip_higher_and_dual_clip():
    logp = torch.log(T([[1.5, 5.0]]))
    old = torch.zeros_like(logp)
    loss, _ = clipped_policy_loss(logp, old, T([[1.0, 1.0]]), clip_eps=0.2, clip_eps_high=0.28)
    np.testing.assert_allclose(loss.numpy(), [[-1.28, -1.28]], rtol=1e-6)
    loss, clipped = clipped_policy_loss(logp, old, T([[-1.0, -1.0]]), clip_eps=0.2, dual_clip_c=3.0)
    np.testing.assert_allclose(loss.numpy(), [[1.5, 3.0]], rtol=1e-6)  # -A r = 5 capped at -A c = 3
    assert clipped.tolist() == [[0.0, 1.0]]


def test_grpo_broadcasts_sample_advantage_over_tokens():
    logp = torch.zeros(2, 3)
    loss, _ = clipped_policy_loss(logp, logp, T([[2.0], [-1.0]]), clip_eps=0.2)
    assert loss.tolist() == [[-2.0] * 3, [1.0] * 3]


# ----- aggregation -----
VALUES = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_token_and_seq_mean():
    assert aggregate(VALUES, MASK, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(VALUES, MASK, "seq_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(VALUES, MASK, "token_mean", total_tokens=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(VALUES, MASK, "sum")


def test_micro_batch_parts_add_up_to_the_batch_loss():
    for mode in ("token_mean", "seq_mean"):
        whole = aggregate(VALUES, MASK, mode)
        parts = sum(aggregate(VALUES[i:i + 1], MASK[i:i + 1], mode, total_tokens=4, total_seqs=2) for i in range(2))
        assert parts.item() == pytest.approx(whole.item())


def test_empty_mask_gives_zero_not_nan():
    zero = torch.zeros_like(MASK)
    assert aggregate(VALUES, zero, "token_mean").item() == 0.0
    assert aggregate(VALUES, zero, "seq_mean").item() == 0.0


# ----- logprobs and entropy -----
def test_token_logprobs_and_entropy_with_temperature():
    head = torch.nn.Linear(4, 4, bias=False)
    head.weight.data = torch.eye(4)  # logits = hidden
    hidden = T([[math.log(1.0), math.log(3.0), -1e4, -1e4], [0.0, 0.0, 0.0, 0.0]])  # softmax [.25, .75, 0, 0]; uniform
    logp, entropy = chunked_token_logprobs(hidden, head, torch.tensor([1, 2]), 1.0, chunk_tokens=1, with_entropy=True)
    np.testing.assert_allclose(logp.detach().numpy(), [math.log(0.75), math.log(0.25)], atol=1e-6)
    np.testing.assert_allclose(entropy.numpy(), [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(4)],
                               atol=1e-6)
    # T = 2: softmax of log([1, 3]) / 2 = [1, sqrt 3] / (1 + sqrt 3)
    logp, _ = chunked_token_logprobs(hidden[:1], head, torch.tensor([1]), 2.0, chunk_tokens=1)
    assert logp.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)
