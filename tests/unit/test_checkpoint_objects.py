"""infra/storage/checkpoint_objects.py: tensors and arrays of every dtype and odd shape round trip through the safetensors
library on file:// (save_file / safe_open, mapped, from 1 MiB on) and as bytes (small objects, and S3); overlapping tensors (tied
weights) are stored once each; a checkpoint written by the earlier hand-written codec still loads; an object
that is not safetensors is one clear CheckpointError."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from spillover.infra.storage import checkpoint_objects as objects_io
from spillover.infra.storage.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, CheckpointState
from spillover.infra.storage.store import open_store

V1 = Path(__file__).resolve().parents[1] / "data" / "checkpoint_v1"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _no_check(info) -> None:
    pass


def test_tensors_round_trip_every_dtype_and_shape(tmp_path):
    w = torch.randn(4, 2)
    tensors = {"f32": torch.randn(3, 4, requires_grad=True), "bf16": torch.randn(5).to(torch.bfloat16),
               "scalar": torch.tensor(7), "empty": torch.zeros(0, 3), "bool": torch.tensor([True, False]),
               "fp8": torch.ones(3).to(torch.float8_e4m3fn), "u16": torch.tensor([1, 2]).to(torch.uint16),
               "bf16_scalar": torch.tensor(2.5, dtype=torch.bfloat16), "transposed": torch.randn(4, 2).t(),
               "tied_a": w, "tied_b": w, "half_view": w.reshape(-1)[:4],
               "big": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB: the mapped path (save_file / safe_open)
    prepared = objects_io.tensors_for_save("policy", tensors)
    assert prepared["tied_a"] is w and prepared["tied_b"].data_ptr() != w.data_ptr()  # one copy for the overlap
    store = open_store(str(tmp_path))
    info = objects_io.put_object(store, "t.safetensors", objects_io.TENSORS, prepared)
    assert info.sha256 == hashlib.sha256((tmp_path / "t.safetensors").read_bytes()).hexdigest()
    mapped = objects_io.read_object(store, "t.safetensors", objects_io.TENSORS, info.size, _no_check)
    from_bytes = safetensors.torch.load(objects_io.object_bytes(objects_io.TENSORS, prepared))
    for name, t in tensors.items():
        want = t.detach()
        for back in (mapped[name], from_bytes[name]):
            assert back.dtype == want.dtype and back.shape == want.shape and torch.equal(_raw(back), _raw(want)), name
    assert mapped["big"].untyped_storage().nbytes() == 1 << 20  # its own bytes only (pickles small to actors)
    mapped["f32"][0, 0] = 123.0  # copy-on-write: the file keeps its bytes
    again = objects_io.read_object(store, "t.safetensors", objects_io.TENSORS, info.size, _no_check)
    assert torch.equal(again["f32"], tensors["f32"].detach())


def test_arrays_round_trip_and_strings_are_refused(tmp_path):
    arrays = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "age": np.array([0, 1], dtype=np.int8),
              "x": np.float64(2.5) * np.ones(()), "cols": np.arange(6.0).reshape(2, 3).T, "done": np.array([True])}
    prepared = objects_io.arrays_for_save("dock", arrays)
    store = open_store(str(tmp_path))
    info = objects_io.put_object(store, "a.safetensors", objects_io.ARRAYS, prepared)
    for got in (objects_io.read_object(store, "a.safetensors", objects_io.ARRAYS, info.size, _no_check),
                safetensors.numpy.load(objects_io.object_bytes(objects_io.ARRAYS, prepared))):
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and got[name].shape == a.shape and np.array_equal(got[name], a), name
    with pytest.raises(objects_io.ObjectFormatError, match="dock.names: dtype <U1 cannot be stored"):
        objects_io.arrays_for_save("dock", {"names": np.array(["a", "b"])})


def test_a_checkpoint_written_by_the_hand_written_codec_still_loads(tmp_path):
    """tests/data/checkpoint_v1 was written by infra/tensor_codec.py (commit e5710dd) before this library swap."""
    shutil.copytree(V1, tmp_path / "v1")
    got = load_checkpoint(open_store(str(tmp_path / "v1")), 7)
    policy = got.tensors["policy"]
    assert torch.equal(policy["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(policy["bf"], torch.arange(5).to(torch.bfloat16)) and policy["step"].item() == 10.0
    assert policy["mask"].tolist() == [True, False] and policy["half"].dtype == torch.float16
    assert policy["empty"].shape == (0, 2) and policy["ids"].tolist() == list(range(6))
    dock = got.arrays["dock"]
    assert dock["tokens"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and dock["age"].dtype == np.int8
    assert dock["done"].tolist() == [True, False] and np.allclose(dock["logprobs"], np.linspace(-1, 0, 4))
    assert got.meta == {"note": "written by the hand-written codec", "cursor": [1, 2]}


def test_an_object_that_is_not_safetensors_is_one_clear_error(tmp_path):
    store = open_store(str(tmp_path))
    save_checkpoint(store, CheckpointState(1, {"policy": {"w": torch.ones(3)}}, {}, {}))
    key = "ckpt-00000001/tensors/policy-00000.safetensors"
    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00not a header...."
    store.put_bytes(key, garbage)  # with a manifest that vouches for it: only the decoder can object
    manifest = json.loads(store.get_bytes("ckpt-00000001/manifest.json"))
    manifest["objects"]["tensors/policy-00000.safetensors"] = {"size": len(garbage),
                                                              "sha256": hashlib.sha256(garbage).hexdigest()}
    store.put_bytes("ckpt-00000001/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="policy-00000.safetensors does not decode"):
        load_checkpoint(store, 1)


@pytest.mark.parametrize("count", [1_000, 200_000], ids=["small", "large_written_in_place"])
def test_values_safetensors_cannot_hold_are_refused_as_such_at_any_size(tmp_path, count):
    """A large local object is written through the store's retried write: its format error stays a format error
    (CheckpointError naming the dtype), not a storage failure whose fix is a writable directory."""
    from spillover.infra.storage.checkpoint import CheckpointError, CheckpointState, save_checkpoint
    from spillover.infra.storage.store import open_store

    state = CheckpointState(1, {}, {"dock": {"x": np.zeros(count, dtype=np.longdouble)}}, {})
    with pytest.raises(CheckpointError, match="cannot be stored in safetensors") as err:
        save_checkpoint(open_store(str(tmp_path)), state)
    assert "writable directory" not in str(err.value)
