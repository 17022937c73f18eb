"""Issue 28 item 2: a learner configured as the GPU recipes are (model.dtype=bfloat16, learner.param_dtype=bfloat16)
keeps float32 masters and AdamW moments, computes in bfloat16, and sends bfloat16 weights to engines; at the recipes'
lr 1e-6 its step survives (bfloat16 masters would round it away). In process at world_size 1 (autocast), and as a
world_size 2 group on real Ray with gloo + FSDP2 (MixedPrecisionPolicy)."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spillover.bench.weight_digests import learner_group_weight_digests, learner_weight_digests, tensor_digest
from spillover.infra.config.run_config import build_config
from spillover.infra.config.training import GRPOConfig, OptimizerConfig
from spillover.infra.config.learner import LearnerConfig
from learner_batches import random_batch
from spillover.tasks.learner.actor import LearnerActor

BF16 = ["model.dtype=bfloat16", "learner.param_dtype=bfloat16", "optimizer.lr=1e-6"]


def bf16_learner(tiny_model_dir, lr: float = 1e-6, **lcfg) -> LearnerActor:
    return LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=4), OptimizerConfig(lr=lr), 1.0, 0, True,
                        dtype="bfloat16", learner_cfg=LearnerConfig(param_dtype="bfloat16", **lcfg))


def changed_share(before: dict, after: dict) -> float:
    """Share of all parameter elements that differ between two state dicts."""
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


def moments(optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for name, value in state.items() if name != "step"]


def test_bf16_learner_steps_at_lr_1e6_on_float32_masters_and_sends_bf16(tiny_model_dir, tmp_path):
    learner = bf16_learner(tiny_model_dir)
    compute = set()  # what a decoder matmul produced: the compute dtype
    learner.model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: compute.add(out.dtype))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    assert {v.dtype for v in before.values()} == {torch.float32}

    batch = random_batch(0)
    metrics = learner.update(batch, learner.compute_logprobs(batch))
    assert metrics["stepped"] and metrics["lr"] == 1e-6 and compute == {torch.bfloat16}
    after = learner.model.state_dict()
    assert {v.dtype for v in after.values()} == {torch.float32}
    # Adam's first step moves every weight with a gradient by ~lr: visible in float32, under half a bfloat16 ulp
    # for all but the smallest weights (as bfloat16 masters, most of the step would round away)
    assert changed_share(before, after) > 0.9
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in after.items()}
    assert changed_share({k: v.to(torch.bfloat16) for k, v in before.items()}, as_bf16) < 0.1
    exp = moments(learner.optimizer)
    assert exp and {v.dtype for v in exp} == {torch.float32}

    # engines get model.dtype: the object-store dict, the distributed/colocated specs and digests, the disk folder
    sent = learner.state_dict_ref()
    assert {v.dtype for v in sent.values()} == {torch.bfloat16} and all(torch.equal(sent[k], as_bf16[k]) for k in sent)
    assert {dtype for _, dtype, _ in learner.weight_specs()} == {"bfloat16"}
    assert learner_weight_digests(learner) == {k: tensor_digest(as_bf16[k]) for k in learner.state_keys}
    folder = learner.save_weights(str(tmp_path / "w1"))
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "w1" / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_learner_state_is_float32_resumes_exactly_and_loads_a_bf16_state(tiny_model_dir, tmp_path):
    """The checkpointed state holds the float32 masters and moments (safetensors, same format); a resume from it
    equals the uninterrupted run bit for bit; a state written by bfloat16 masters (what a recipe run saved before
    masters were float32: same keys, bfloat16 tensors) loads, widened exactly."""
    b1, b2 = random_batch(10), random_batch(11, version=1)
    straight = bf16_learner(tiny_model_dir)
    straight.update(b1)
    tensors, meta = straight.get_state()
    floats = {k: v.dtype for k, v in tensors.items() if k.startswith(("model/", "optim/")) and not k.endswith("/step")}
    assert set(floats.values()) == {torch.float32}
    save_file(tensors, tmp_path / "state.safetensors")
    straight.update(b2)

    resumed = bf16_learner(tiny_model_dir)
    resumed.set_state(load_file(tmp_path / "state.safetensors"), meta)
    resumed.update(b2)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    old = {k: v.to(torch.bfloat16) if k in floats else v for k, v in tensors.items()}
    save_file(old, tmp_path / "old.safetensors")
    widened = bf16_learner(tiny_model_dir)
    widened.set_state(load_file(tmp_path / "old.safetensors"), meta)
    state = widened.model.state_dict()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], old[f"model/{k}"].float())
               for k in widened.state_keys)
    assert {v.dtype for v in moments(widened.optimizer)} == {torch.float32}
    assert widened.update(b2)["stepped"]


@pytest.fixture(scope="module")
def bf16_group(tiny_model_dir, ray_session):
    from spillover.tasks.learner.group import create_learner_group

    cfg = build_config(overrides=[*BF16, "learner.world_size=2", "grpo.micro_batch_size=4", "grpo.kl_coef=0",
                                  "rollout.global_batch_size=2", "rollout.n_samples_per_prompt=4"])
    group = create_learner_group(tiny_model_dir, cfg, trainable=True)
    yield group
    group.shutdown()


def test_bf16_fsdp2_group_keeps_float32_masters_and_sends_bf16(bf16_group, tiny_model_dir, ray_session):
    """world_size 2 (gloo, FSDP2 with param_dtype bfloat16): the same rule as one process."""
    ray = ray_session
    batch = random_batch(3, max_response=14)
    before, _ = ray.get(bf16_group.get_state.remote())
    assert {v.dtype for k, v in before.items() if k.startswith("model/")} == {torch.float32}
    old = ray.get(bf16_group.compute_logprobs.remote(batch))
    full_precision = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=4), OptimizerConfig(), 1.0, 0, True)
    gap = float(np.abs(old - full_precision.compute_logprobs(batch)).max())
    assert 1e-4 < gap < 0.2  # bfloat16 compute: off float32's logprobs by rounding, not by a bug

    assert ray.get(bf16_group.update.remote(batch, old))["stepped"]
    after, _ = ray.get(bf16_group.get_state.remote())
    model = {k: v for k, v in after.items() if k.startswith("model/")}
    assert {v.dtype for v in model.values()} == {torch.float32}
    assert changed_share({k: before[k] for k in model}, model) > 0.9
    optim = {v.dtype for k, v in after.items() if k.startswith("optim/") and not k.endswith("/step")}
    assert optim == {torch.float32}

    sent = ray.get(bf16_group.state_dict_ref.remote())
    assert {v.dtype for v in sent.values()} == {torch.bfloat16}
    assert all(torch.equal(sent[k[len("model/"):]], v.to(torch.bfloat16)) for k, v in model.items())
    assert {dtype for _, dtype, _ in ray.get(bf16_group.weight_specs.remote())} == {"bfloat16"}
    # every rank casts its shard and gathers (tasks/weight_sync.full_tensor): the bytes engines receive
    digests = learner_group_weight_digests(bf16_group)
    assert digests == {k: tensor_digest(sent[k]) for k in digests}
