"""Distributed weight sync on real parts (issue 13): a learner group of two FSDP ranks on gloo (rank 0 gathers each
bucket from the shards and broadcasts it), the session's two torch engines as Ray actors behind the real router,
SGLang's HTTP protocol between them. A bucket smaller than the largest tensor, three real GRPO updates each followed
by a sync: every engine's weights equal the learner's bit for bit (/get_weights_by_name) and report the version;
an engine SIGKILLed between updates is restarted by the manager, rejoins a new group and serves the current weights
(found by the health check, or by the next sync itself).
"""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import ray
import torch

from fleet_probes import health_check, take_update_peak_bytes
from spillover.infra.config.run_config import build_config
from spillover.rollout.fleet.weights.weight_update import WeightUpdate
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest
from learner_batches import random_batch


@pytest.fixture(scope="module")
def policy(tiny_model_dir, ray_session):
    from spillover.tasks.learner.group import create_learner_group

    cfg = build_config(overrides=["grpo.kl_coef=0", "grpo.micro_batch_size=2", "rollout.global_batch_size=2",
                                  "rollout.n_samples_per_prompt=4", "optimizer.lr=0.01", "learner.world_size=2"])
    group = create_learner_group(tiny_model_dir, cfg, trainable=True)
    yield group
    group.shutdown()


def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    with httpx.Client(timeout=60) as client:
        for name in names:
            response = client.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10**6})
            assert response.status_code == 200, response.text
            out[name] = torch.tensor(response.json(), dtype=torch.float32)
    return out


def assert_engines_hold(manager, learner_state: dict[str, torch.Tensor], version: int) -> None:
    for handle in manager.engines:
        got = engine_weights(handle.url, list(learner_state))
        for name, tensor in learner_state.items():
            assert torch.equal(got[name], tensor.float()), f"engine {handle.index}: {name} differs"
        assert httpx.get(handle.url + "/model_info").json()["weight_version"] == str(version)
    assert set(manager.weight_versions.values()) == {version}


def test_three_bucketed_syncs_then_a_killed_engine_rejoins(rollout_manager, policy, varied_model_dir):
    m = rollout_manager
    specs = ray.get(policy.weight_specs.remote())
    largest = max(int(np.prod(shape)) * 4 for _, _, shape in specs)
    sync = m.weights.distributed
    shared_bucket_bytes = sync.bucket_bytes  # the session's manager: the next tests get it back
    # peaks from here on (earlier whole-dict loads)
    ray.get([h.actors[0].__ray_call__.remote(take_update_peak_bytes) for h in m.engines])
    try:
        sync.bucket_bytes = largest // 2  # smaller than the largest tensor: that one goes alone
        for step in range(1, 4):
            metrics = ray.get(policy.update.remote(ray.put(random_batch(step, max_response=14)), None, None))
            version = int(metrics["weight_version"])
            assert version == step
            reported = m.update_weights(WeightUpdate("distributed", policy, version))
            assert reported == {h.index: version for h in m.engines}
            state = ray.get(policy.state_dict_ref.remote())
            assert_engines_hold(m, state, version)
            assert sync.last["buckets"] > len(specs) // 4 and sync.last["bytes"] > 0
            # memory beyond the model during the sync (tensor bytes; RSS is too coarse at this size): the learner
            # ranks hold one bucket's gathered tensors at a time, an engine one received bucket (loads are in place)
            assert 0 < sync.last["peak_extra_bytes"] <= 2 * largest, sync.last
            peaks = ray.get([h.actors[0].__ray_call__.remote(take_update_peak_bytes) for h in m.engines])
            assert all(0 < peak <= largest for peak in peaks), peaks
        victim = m.engines[1]
        os.kill(victim.pids[0], signal.SIGKILL)
        restarts = m.restarts
        assert health_check(m)[1] == "restarted" and m.restarts == restarts + 1
        assert m.engines[1].url != victim.url
        assert_engines_hold(m, state, 3)  # the new engine rejoined a new group and got version 3's weights
        out = m.generate([GenerateJob(GenerateRequest(input_ids=[5, 6, 7],
                                                      sampling_params={"max_new_tokens": 4, "temperature": 0}))])
        assert out[0].meta_info.weight_version == 3
        victim = m.engines[0]  # dead when the next sync starts: the sync restarts it and still reaches everyone
        os.kill(victim.pids[0], signal.SIGKILL)
        ray.get(policy.update.remote(ray.put(random_batch(4, max_response=14)), None, None))
        assert m.update_weights(WeightUpdate("distributed", policy, 4)) == {0: 4, 1: 4}
        assert m.engines[0].url != victim.url
        assert_engines_hold(m, ray.get(policy.state_dict_ref.remote()), 4)
    finally:
        sync.bucket_bytes = shared_bucket_bytes
        m._call(sync.leave)
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))  # the session's engines back to the checkpoint


class SenderFailingAtOnce:
    """The policy group, except that its broadcast fails before sending anything (it is asked for a tensor it does
    not hold) while the engines already wait in their receive of the first bucket."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        return getattr(self.group, name)

    @property
    def broadcast_weights(self):
        return SimpleNamespace(remote=lambda name, buckets: self.group.broadcast_weights.remote(name, [["no.such"]]))


def test_a_failing_sender_ends_the_sync_at_once_and_the_next_sync_works(rollout_manager, policy, varied_model_dir):
    m = rollout_manager
    assert m.weights.distributed.timeout_s >= 600  # the engines' receive would wait this long for a sender that is gone
    try:
        tic = time.monotonic()
        with pytest.raises(Exception, match="no.such"):
            m.update_weights(WeightUpdate("distributed", SenderFailingAtOnce(policy), 7))
        assert time.monotonic() - tic < 60
        version = int(ray.get(policy.weight_version.remote()))
        assert m.update_weights(WeightUpdate("distributed", policy, version)) == {h.index: version for h in m.engines}
        assert_engines_hold(m, ray.get(policy.state_dict_ref.remote()), version)
    finally:
        m._call(m.weights.distributed.leave)
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))


class SenderFailingAfterFirstBucket:
    """The policy group, except that its broadcast ends with an error once the first bucket is sent: the engines have
    loaded that bucket and wait in their receive of the second."""

    def __init__(self, group):
        self.group = group
        self.syncs = 0

    def __getattr__(self, name):
        return getattr(self.group, name)

    @property
    def broadcast_weights(self):
        async def first_bucket_then_fail(name, buckets):
            self.syncs += 1
            await self.group.broadcast_weights.remote(name, buckets[:1])
            raise RuntimeError("the sender failed after the first bucket")

        return SimpleNamespace(remote=first_bucket_then_fail)


def test_a_sync_failing_midway_leaves_the_old_version_and_is_sent_again(rollout_manager, policy, varied_model_dir):
    """The version comes with the last bucket only: after a sync that loaded some buckets and failed, every engine
    still reports its old version (the weights are partly new, so the manager sends the whole update once more before
    it gives up), and the next sync loads the learner's weights whole."""
    m = rollout_manager
    sync = m.weights.distributed
    shared_bucket_bytes = sync.bucket_bytes
    before = dict(m.weight_versions)
    sender = SenderFailingAfterFirstBucket(policy)
    try:
        sync.bucket_bytes = 4096  # several buckets
        with pytest.raises(Exception, match="after the first bucket"):
            m.update_weights(WeightUpdate("distributed", sender, 9))
        assert sender.syncs == 2  # the failed sync, then the whole update once more
        assert m.weight_versions == before
        for handle in m.engines:
            assert httpx.get(handle.url + "/model_info").json()["weight_version"] != "9", handle.url
        version = int(ray.get(policy.weight_version.remote()))
        assert m.update_weights(WeightUpdate("distributed", policy, version)) == {h.index: version for h in m.engines}
        assert_engines_hold(m, ray.get(policy.state_dict_ref.remote()), version)
    finally:
        sync.bucket_bytes = shared_bucket_bytes
        m._call(sync.leave)
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))


def test_a_send_failing_on_rank_0_alone_leaves_the_ranks_in_step(rollout_manager, policy, varied_model_dir):
    """Rank 0's send fails after the first bucket while rank 1 gathers on: rank 0 still joins every gather (the
    collectives) and raises after, so the sync fails at once and the next one finds both ranks in step (before, rank 1
    waited in a gather rank 0 never joined, and the next sync's gathers paired with the leftovers)."""
    from fleet_probes import fail_sends_after

    m = rollout_manager
    sync = m.weights.distributed
    shared_bucket_bytes = sync.bucket_bytes
    rank0 = policy.actors[0]
    try:
        sync.bucket_bytes = 4096  # several buckets
        ray.get(rank0.__ray_call__.remote(fail_sends_after, 1))
        version = int(ray.get(policy.weight_version.remote()))
        tic = time.monotonic()
        with pytest.raises(Exception, match="rank 0's send failed"):
            m.update_weights(WeightUpdate("distributed", policy, version))
        assert time.monotonic() - tic < 60
        ray.get(rank0.__ray_call__.remote(fail_sends_after, None))
        assert m.update_weights(WeightUpdate("distributed", policy, version)) == {h.index: version for h in m.engines}
        assert_engines_hold(m, ray.get(policy.state_dict_ref.remote()), version)
    finally:
        ray.get(rank0.__ray_call__.remote(fail_sends_after, None))
        sync.bucket_bytes = shared_bucket_bytes
        m._call(sync.leave)
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))


def test_tensor_sync_fetches_and_frees_the_learners_tensors_bucket_by_bucket(rollout_manager, policy,
                                                                             varied_model_dir):
    """engines.weight_sync=tensor from the learner group (issue 37, item 7): the learner puts each tensor in its own
    object, and each engine actor fetches a bucket's tensors at a time, posts them and drops them before the next
    (a post per bucket, as plan_buckets groups the specs), so its process never holds the model a second time (the
    old actor unpickled the whole state dict before the first post). Counted from the engine's process itself: the
    tensors alive there as each bucket is loaded, beyond the engine's own weights and KV cache."""
    from spillover.rollout.fleet.weights.fleet_weights import policy_update
    from spillover.rollout.sglang.update_group import dtype_name, plan_buckets, spec_bytes
    from fleet_probes import take_held_tensor_bytes, take_weight_update_events, watch_held_tensor_bytes

    m = rollout_manager
    sent = ray.get(policy.state_dict_ref.remote())  # what the sync sends, in its order
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in sent.items()]
    model_bytes, largest = sum(map(spec_bytes, specs)), max(map(spec_bytes, specs))
    tensor = m.weights.tensor
    shared_bucket_bytes = tensor.bucket_bytes
    watched = False
    try:
        tensor.bucket_bytes = max(largest, model_bytes // 8)
        buckets = plan_buckets(specs, tensor.bucket_bytes)
        assert len(buckets) > 4 and 3 * tensor.bucket_bytes < model_bytes
        ray.get([h.actors[0].__ray_call__.remote(take_weight_update_events) for h in m.engines])
        ray.get([h.actors[0].__ray_call__.remote(watch_held_tensor_bytes) for h in m.engines])
        watched = True
        version = int(ray.get(policy.weight_version.remote()))
        update = policy_update(policy, version, m.cfg.model_copy(update={"weight_sync": "tensor"}), m.model_path,
                               colocated=False)
        assert m.update_weights(update) == {h.index: version for h in m.engines}
        for events in ray.get([h.actors[0].__ray_call__.remote(take_weight_update_events) for h in m.engines]):
            assert events == ["begin_weight_update", *["update_weights_from_tensor"] * len(buckets),
                              "end_weight_update"], events
        held = ray.get([h.actors[0].__ray_call__.remote(take_held_tensor_bytes) for h in m.engines])
        watched = False
        bound = 3 * max(tensor.bucket_bytes, largest)  # a few copies of one bucket (the actor's, the server's
        assert bound < model_bytes / 2                  # received one, its encoding): never the model (the old actor
        for per_load in held:                           # held all of it, ~1.1x model_bytes here)
            assert len(per_load) == len(buckets) and 0 < max(per_load) <= bound, held
        assert_engines_hold(m, sent, version)
    finally:
        if watched:
            ray.get([h.actors[0].__ray_call__.remote(take_held_tensor_bytes) for h in m.engines])
        tensor.bucket_bytes = shared_bucket_bytes
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))


def test_flow_trains_with_distributed_weight_sync(prefect_harness, ray_session, warm_parts, tmp_path, monkeypatch):
    """engines.weight_sync=distributed through the flow's update task: two iterations, each update sent to the
    engines in several buckets by the distributed path (a spy counts its syncs), the sync timed."""
    import json

    from spillover.rollout.fleet.weights.fleet_weights import DistributedWeights

    syncs, real_sync = [], DistributedWeights.sync

    async def spy(self, policy, urls, version, flush_cache=True):
        await real_sync(self, policy, urls, version, flush_cache)
        syncs.append((version, self.last["buckets"]))

    monkeypatch.setattr(DistributedWeights, "sync", spy)

    from spillover.flows.train import grpo_train
    from spillover.infra.config.run_config import load_config
    from small_run import SMALL_RUN

    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path / 'run'}", "schedule.num_iterations=2", *SMALL_RUN,
                                            "tracking.wandb_mode=disabled", "engines.weight_sync=distributed",
                                            "engines.weight_bucket_bytes=65536"])
    assert grpo_train(cfg, parts=warm_parts)["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert all(r["weight_sync_s"] > 0 for r in rows)
    assert [v for v, _ in syncs] == [1, 2] and all(buckets > 1 for _, buckets in syncs), syncs
