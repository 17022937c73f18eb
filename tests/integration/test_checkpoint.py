"""infra/storage/checkpoint.py against file:// and a real S3 server: round trip of model + AdamW + dock + meta,
corrupt/truncated/incomplete checkpoints skipped with a warning, pruning (S3 outages during a write:
test_checkpoint_outages.py)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import safetensors.torch
import torch

from spillover.infra.storage.checkpoint import (CheckpointError, CheckpointState, list_checkpoints, load_checkpoint,
                              load_latest_checkpoint, prune, save_checkpoint)
from spillover.infra.config.run_config import RunConfig
from spillover.bench.reference_lm import load_causal_lm
from spillover.infra.storage.store import open_store
from spillover.tasks.learner.state import load_state, save_state, unique_state_keys


def _train_step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _state(iteration, model, opt, extra=0) -> CheckpointState:
    """A run's checkpoint in small: the learner's optimizer tensors as tasks/learner/state.py writes them."""
    learner_tensors, learner_meta = save_state(model, model, opt, [], unique_state_keys(model), sharded=False,
                                               version=iteration + 1, trainable=True)
    opt_tensors = {k: v for k, v in learner_tensors.items() if k.startswith("optim/")}
    dock = {"tokens": np.arange(40, dtype=np.int32).reshape(4, 10) + extra,
            "logprobs": np.linspace(-3, 0, 40, dtype=np.float32).reshape(4, 10),
            "age": np.array([0, 1, 2, 0], dtype=np.int8), "done": np.array([True, False, True, True])}
    meta = {"weight_version": iteration + 1, "wandb_run_id": "abc123", "learner": learner_meta,
            "data_cursor": {"epoch": 0, "position": 17 + extra, "buffer": [[3, 4], [5]]},
            "config": RunConfig().model_dump(mode="json")}
    return CheckpointState(iteration, {"policy": model.state_dict(), "optimizer": opt_tensors}, {"dock": dock}, meta)


@pytest.fixture
def model_and_opt(tiny_model_dir):
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, seed=1)
    return model, opt


def test_round_trip_restores_model_optimizer_dock_meta(storage_target, model_and_opt, tiny_model_dir):
    model, opt = model_and_opt
    store = open_store(storage_target.url, storage_target.cfg)
    assert load_latest_checkpoint(store) is None
    state = _state(3, model, opt)
    url = save_checkpoint(store, state, keep=2, max_object_bytes=64 << 10)  # small shards: several objects
    assert url == f"{storage_target.url}/ckpt-00000003"
    manifest = json.loads(store.get_bytes("ckpt-00000003/manifest.json"))
    assert len(manifest["groups"]["tensors"]["policy"]) > 1

    got = load_latest_checkpoint(store)
    assert got.iteration == 3 and got.meta == json.loads(json.dumps(state.meta))
    for group in ("policy", "optimizer"):
        assert got.tensors[group].keys() == state.tensors[group].keys()
        for name, t in state.tensors[group].items():
            assert got.tensors[group][name].dtype == t.dtype and torch.equal(got.tensors[group][name], t), name
    for name, a in state.arrays["dock"].items():
        assert got.arrays["dock"][name].dtype == a.dtype and np.array_equal(got.arrays["dock"][name], a)

    # resume: a fresh model + optimizer from the checkpoint takes exactly the same next step
    model2 = load_causal_lm(tiny_model_dir)
    model2.load_state_dict(got.tensors["policy"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    keys = unique_state_keys(model2)
    learner_tensors = {**{f"model/{k}": got.tensors["policy"][k] for k in keys}, **got.tensors["optimizer"]}
    load_state(model2, model2, opt2, [], keys, False, learner_tensors, got.meta["learner"], str(tiny_model_dir))
    _train_step(model, opt, seed=2)
    _train_step(model2, opt2, seed=2)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name


def test_objects_are_standard_safetensors(tmp_path, model_and_opt):
    model, opt = model_and_opt
    store = open_store(str(tmp_path))
    save_checkpoint(store, _state(1, model, opt))
    loaded = safetensors.torch.load_file(str(tmp_path / "ckpt-00000001/tensors/policy-00000.safetensors"))
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t)


def _flip_bytes(store, key):
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))


def test_corrupt_truncated_or_missing_objects_fall_back(storage_target, model_and_opt, caplog):
    model, opt = model_and_opt
    store = open_store(storage_target.url, storage_target.cfg)
    for it in (1, 2, 3, 4, 5):
        save_checkpoint(store, _state(it, model, opt, extra=it))
    store.put_bytes("ckpt-00000005/meta.json", b"")  # on S3 a ranged read of an empty object is refused (416)
    _flip_bytes(store, "ckpt-00000004/tensors/optimizer-00000.safetensors")
    manifest = store.get_bytes("ckpt-00000003/manifest.json")
    store.put_bytes("ckpt-00000003/manifest.json", manifest[: len(manifest) // 2])
    store.delete("ckpt-00000002/arrays/dock-00000.safetensors")
    caplog.set_level(logging.INFO, logger="spillover.checkpoint")
    got = load_latest_checkpoint(store)
    assert got.iteration == 1 and got.meta["data_cursor"]["position"] == 18
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert "ckpt-00000005/meta.json is corrupt: 0 bytes" in warnings[0]
    assert "ckpt-00000004/tensors/optimizer-00000.safetensors is corrupt" in warnings[1]
    assert "ckpt-00000003/manifest.json is unreadable" in warnings[2]
    assert "ckpt-00000002/arrays/dock-00000.safetensors listed in the manifest is missing" in warnings[3]
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(store, 4)


def test_after_a_fall_back_the_next_save_keeps_the_good_checkpoints_and_none_usable_raises(storage_target):
    """ckpt 5's manifest is valid JSON but damaged: the resume falls back to 2 (no KeyError). The run then writes 3
    with keep 1: 5 (after it, unusable) goes, and 3 is kept, not 5. With no checkpoint left that verifies, loading
    raises instead of starting the run over."""
    store = open_store(storage_target.url, storage_target.cfg)
    small = CheckpointState(0, {"policy": {"w": torch.ones(3)}}, {}, {})
    for it in (1, 2, 5):
        small.iteration = it
        save_checkpoint(store, small)
    manifest = json.loads(store.get_bytes("ckpt-00000005/manifest.json"))
    for spec in manifest["objects"].values():
        spec["sha25v"] = spec.pop("sha256")
    store.put_bytes("ckpt-00000005/manifest.json", json.dumps(manifest).encode())
    assert load_latest_checkpoint(store).iteration == 2
    small.iteration = 3
    save_checkpoint(store, small, keep=1)
    assert [(i.iteration, i.complete) for i in list_checkpoints(store)] == [(3, True)]
    _flip_bytes(store, "ckpt-00000003/tensors/policy-00000.safetensors")
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies .*ckpt-00000003: object"):
        load_latest_checkpoint(store)


def test_checkpoint_without_manifest_does_not_exist(storage_target, model_and_opt):
    model, opt = model_and_opt
    store = open_store(storage_target.url, storage_target.cfg)
    save_checkpoint(store, _state(1, model, opt))
    save_checkpoint(store, _state(2, model, opt))
    store.delete("ckpt-00000002/manifest.json")  # as if the writer died before the manifest
    assert [(i.iteration, i.complete) for i in list_checkpoints(store)] == [(1, True), (2, False)]
    assert load_latest_checkpoint(store).iteration == 1
    save_checkpoint(store, _state(2, model, opt))  # the same iteration again replaces the leftover
    assert load_latest_checkpoint(store).iteration == 2


def test_prune_keeps_the_newest_complete(storage_target, model_and_opt):
    model, opt = model_and_opt
    store = open_store(storage_target.url, storage_target.cfg)
    small = CheckpointState(0, {"policy": {"w": torch.ones(3)}}, {}, {})
    for it in range(5):
        small.iteration = it
        save_checkpoint(store, small, keep=2)
    assert [i.iteration for i in list_checkpoints(store)] == [3, 4]
    store.put_bytes("ckpt-00000001/tensors/policy-00000.safetensors", b"leftover")  # a crashed old write
    small.iteration = 5
    save_checkpoint(store, small)
    assert prune(store, 1) == ["ckpt-00000001", "ckpt-00000003", "ckpt-00000004"]
    assert [i.iteration for i in list_checkpoints(store)] == [5]
    assert store.list() == ["ckpt-00000005"]


def test_bad_meta_refused_clearly(s3_server):
    store = open_store(s3_server.url("meta-test"), s3_server.storage_config())
    with pytest.raises(CheckpointError, match=r"meta\.cursor\.pos \(Tensor\)"):
        save_checkpoint(store, CheckpointState(1, meta={"cursor": {"pos": torch.tensor(1)}}))
    leaked = {"storage": {"secret_access_key": s3_server.secret_key}}
    with pytest.raises(CheckpointError, match="model_dump") as err:
        save_checkpoint(store, CheckpointState(1, meta=leaked))
    assert s3_server.secret_key not in str(err.value)
    cfg = RunConfig(storage=s3_server.storage_config()).model_dump(mode="json")
    save_checkpoint(store, CheckpointState(1, meta={"config": cfg}))  # SecretStr dumps masked
    assert s3_server.secret_key not in store.get_bytes("ckpt-00000001/meta.json").decode()
    assert list_checkpoints(store)[0].complete


def test_large_local_objects_corrupt_is_detected_and_loaded_tensors_are_private(tmp_path, caplog):
    """Objects from MMAP_MIN_BYTES on are mapped copy-on-write when loaded from file://: a flipped byte is
    still caught by the sha256 check, and writing to loaded tensors never changes the checkpoint."""
    store = open_store(str(tmp_path / "store"))
    big = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}  # 4 MiB
    for it in (1, 2):
        save_checkpoint(store, CheckpointState(it, {"policy": {k: v + it for k, v in big.items()}}, {}, {"it": it}))
    got = load_checkpoint(store, 2)
    assert torch.equal(got.tensors["policy"]["w"], big["w"] + 2)
    got.tensors["policy"]["w"].zero_()  # a private copy of the touched pages only
    assert torch.equal(load_checkpoint(store, 2).tensors["policy"]["w"], big["w"] + 2)
    del got
    _flip_bytes(store, "ckpt-00000002/tensors/policy-00000.safetensors")
    caplog.set_level(logging.WARNING, logger="spillover.checkpoint")
    assert load_latest_checkpoint(store).meta == {"it": 1}
    assert "ckpt-00000002/tensors/policy-00000.safetensors is corrupt" in caplog.text
