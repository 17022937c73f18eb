"""learner.reference_placement: the KL reference inside the policy's ranks (with_policy, resident or offloaded between
uses) computes the logprobs a reference group of its own computes, bit for bit on CPU (the same weights, the same
FSDP2 sharding and mixed precision, the same micro-batches of the same rows on each rank, the same kernels and
thread count: nothing differs but the process it runs in); it stays the initial model through updates and a
checkpoint round trip; and a flow run trains with it and resumes from a checkpoint."""
import json
import sys

import numpy as np
import pytest
import ray.cloudpickle

from spillover.infra.config.run_config import build_config
from learner_batches import random_batch

# the functions below run inside learner actors (__ray_call__); Ray's workers cannot import this module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
KL = ["grpo.kl_coef=0.05", "grpo.micro_batch_size=2", "rollout.global_batch_size=2", "rollout.n_samples_per_prompt=4",
      "rollout.temperature=0.7", "optimizer.lr=0.01"]


def _learner(tiny_model_dir, placement: str, trainable: bool = True):
    from spillover.tasks.learner.actor import LearnerActor

    cfg = build_config(overrides=[*KL, f"learner.reference_placement={placement}"])
    return LearnerActor(str(tiny_model_dir), cfg.grpo, cfg.optimizer, cfg.rollout.temperature, cfg.model.seed,
                        trainable, total_steps=cfg.schedule.num_iterations, learner_cfg=cfg.learner)


def _storage_bytes(learner) -> tuple[int, int]:
    """(bytes the offloaded reference's parameter storages hold now, bytes of its host copy) in this process."""
    offload = learner.reference.offload
    return sum(s.nbytes() for s in offload.storages), sum(h.numel() for h in offload.host)


@pytest.mark.parametrize("placement", ["with_policy", "with_policy_offloaded"])
def test_reference_in_the_policy_equals_its_own_learner_and_stays_the_initial_model(tiny_model_dir, placement):
    """world_size 1, in process. Offloaded: its storages hold nothing between uses and the whole host copy during
    the pass (read by a forward hook); the reference's logprobs do not move when the policy trains, and a checkpoint
    round trip (get_state / set_state: the policy's state only) leaves the resumed learner's reference the initial
    model again."""
    batch = random_batch(0, n=8)
    own = _learner(tiny_model_dir, "separate", trainable=False)
    expected = own.compute_logprobs(batch)
    policy = _learner(tiny_model_dir, placement)
    during = []
    if placement == "with_policy_offloaded":
        held, host = _storage_bytes(policy)
        assert held == 0 and host >= 4 * sum(p.numel() for p in own.model.parameters())  # float32, each once
        policy.reference.net.register_forward_pre_hook(lambda *_: during.append(_storage_bytes(policy)[0]))
    else:
        assert policy.reference.offload is None
    np.testing.assert_array_equal(policy.compute_ref_logprobs(batch), expected)
    if placement == "with_policy_offloaded":
        assert during and set(during) == {host} and _storage_bytes(policy)[0] == 0
    first = policy.update(batch, policy.compute_logprobs(batch), expected)
    second = policy.update(batch, policy.compute_logprobs(batch), policy.compute_ref_logprobs(batch))
    assert first["kl"] == 0 and second["kl"] > 0, (first["kl"], second["kl"])  # policy == reference at the first
    np.testing.assert_array_equal(policy.compute_ref_logprobs(batch), expected)
    trained = policy.compute_logprobs(batch)
    assert np.abs(trained - expected).max() > 1e-4  # the policy moved, its reference did not

    resumed = _learner(tiny_model_dir, placement)
    resumed.set_state(*policy.get_state())
    np.testing.assert_array_equal(resumed.compute_logprobs(batch), trained)
    np.testing.assert_array_equal(resumed.compute_ref_logprobs(batch), expected)
    with pytest.raises(RuntimeError, match="holds no reference"):
        _learner(tiny_model_dir, "separate").compute_ref_logprobs(batch)


def test_sharded_reference_in_the_policy_equals_the_reference_group(tiny_model_dir, ray_session):
    """world_size 2 (FSDP2 over gloo): the reference in the policy's ranks, offloaded, against a reference group of
    its own, before and after an update (two FSDP2 roots in one process: the policy's backward leaves the
    reference's shards alone); each rank's reference storages hold nothing between passes."""
    from spillover.tasks.learner.group import create_learner_group, create_learners

    ray = ray_session
    cfg = build_config(overrides=[*KL, "learner.world_size=2", "learner.reference_placement=with_policy_offloaded"])
    policy, none = create_learners(tiny_model_dir, cfg)
    separate = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"reference_placement": "separate"})})
    own = create_learner_group(tiny_model_dir, separate, trainable=False)
    try:
        assert none is None and policy.world_size == own.world_size == 2
        batch = random_batch(0, n=8)
        expected = ray.get(own.compute_logprobs.remote(batch))
        np.testing.assert_array_equal(ray.get(policy.compute_ref_logprobs.remote(batch)), expected)
        for held, host in ray.get([a.__ray_call__.remote(_storage_bytes) for a in policy.actors]):
            assert held == 0 and host > 0
        old = ray.get(policy.compute_logprobs.remote(batch))
        assert ray.get(policy.update.remote(batch, old, expected))["kl"] == 0
        np.testing.assert_array_equal(ray.get(policy.compute_ref_logprobs.remote(batch)), expected)
        assert np.abs(ray.get(policy.compute_logprobs.remote(batch)) - expected).max() > 1e-4
    finally:
        policy.shutdown()
        own.shutdown()


def test_a_flow_run_with_the_reference_in_the_policy_trains_and_resumes(prefect_harness, ray_session, warm_parts,
                                                                         tmp_path):
    """grpo.kl_coef > 0 with learner.reference_placement=with_policy: no reference group is started (the engines and
    the policy only), the KL is 0 at the first update (policy = reference) and > 0 after it, and a run resumed from
    checkpoint 0 (the reference loaded from the model folder again) repeats iterations 1 and 2."""
    from spillover.flows.train import grpo_train
    from test_train_flow import resume_from_checkpoint_0, small_config

    run_dir = tmp_path / "run"
    parts_before = warm_parts.started + warm_parts.reused
    grpo_train(small_config(run_dir, iterations=3, **{
        "grpo.kl_coef": 0.05, "learner.reference_placement": "with_policy", "optimizer.lr": 0.01,
        "rollout.deterministic_sampling": "true", "storage.keep_checkpoints": 3,
        "grpo.reward_function_path": "small_run.distinct_chars"}), parts=warm_parts)  # rewards vary: weights move
    assert warm_parts.started + warm_parts.reused - parts_before == 2  # engines and policy: no reference group
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == 0 and all(r["kl"] > 0 for r in rows[1:]), [r["kl"] for r in rows]
    assert all(r["task_s"]["compute_ref_logprob"] > 0 for r in rows)

    resumed_dir = tmp_path / "resumed"
    resume_from_checkpoint_0(run_dir, resumed_dir, warm_parts)
    resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for key in ("kl", "entropy", "reward_mean"):  # iteration 1: the checkpoint's policy against the reloaded reference
        assert resumed[1][key] == rows[1][key], key
    # loss and grad_norm, and from iteration 2 on everything, agree within float rounding: the last bits differ on
    # this in-process resume without a KL term too
    for key in ("kl", "entropy", "reward_mean", "loss", "grad_norm"):
        assert [r[key] for r in resumed[1:]] == pytest.approx([r[key] for r in rows[1:]], rel=1e-5, abs=1e-6), key
