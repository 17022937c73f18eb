"""`spillover eval`'s pieces without engines: a checkpoint's policy (whole, or sliced by learner ranks) becomes an
HF folder with the weights it held, and pass@k is the unbiased estimator."""
from __future__ import annotations

from math import comb

import pytest
import torch
from safetensors.torch import load_file

from spillover.flows.eval import pass_at_k, policy_state, write_policy_folder
from spillover.infra.storage.checkpoint import CheckpointState


def full_state(model_dir) -> dict[str, torch.Tensor]:
    return {f"model/{k}": v for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def sliced(state: dict, world_size: int = 2) -> CheckpointState:
    """The same state as learner ranks write it (tasks/learner/shards.py): dim-0 chunks and their offsets."""
    tensors, infos = {}, []
    for rank in range(world_size):
        part, layout = {}, {}
        for name, value in state.items():
            rows = -(-value.shape[0] // world_size)
            offset = min(rank * rows, value.shape[0])
            part[name] = value[offset:offset + rows].clone()
            layout[name] = {"shape": list(value.shape), "offset": offset}
        tensors[f"policy-rank{rank:03d}"] = part
        infos.append({"rank": rank, "world_size": world_size, "layout": layout, "meta": {} if rank == 0 else None})
    return CheckpointState(iteration=3, tensors=tensors, meta={"learner_shards": infos, "weight_version": 4})


@pytest.mark.parametrize("sharded", [False, True])
def test_policy_folder_holds_the_checkpoint_weights(tiny_model_dir, tmp_path, sharded):
    state = full_state(tiny_model_dir)
    saved = sliced(state) if sharded else CheckpointState(iteration=3, tensors={"policy": state}, meta={})
    out = write_policy_folder(policy_state(saved), tiny_model_dir, tmp_path / "policy")
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == {k.removeprefix("model/") for k in state}
    assert all(torch.equal(written[k.removeprefix("model/")], v) for k, v in state.items())
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 4), (8, 3, 2), (8, 8, 5), (10, 2, 9)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
