"""infra/tensor_codec.py: every dtype and odd shape round trips through standard safetensors bytes, foreign
(unpadded) files decode, and malformed headers are one clear FormatError."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from infra import tensor_codec as codec


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _blob(entries) -> bytearray:
    return bytearray(b"".join(bytes(b) for b in codec.encode(entries)))


def test_tensors_round_trip_every_dtype_and_shape():
    tensors = {"f32": torch.randn(3, 4, requires_grad=True), "bf16": torch.randn(5).to(torch.bfloat16),
               "scalar": torch.tensor(7), "empty": torch.zeros(0, 3), "bool": torch.tensor([True, False]),
               "fp8": torch.ones(3).to(torch.float8_e4m3fn), "u16": torch.tensor([1, 2]).to(torch.uint16),
               "bf16_scalar": torch.tensor(2.5, dtype=torch.bfloat16), "transposed": torch.randn(4, 2).t()}
    blob = _blob({n: codec.tensor_entry(n, t) for n, t in tensors.items()})
    got, _ = codec.decode_tensors(blob)
    official = safetensors.torch.load(bytes(blob))
    for name, t in tensors.items():
        want = t.detach()
        for back in (got[name], official[name]):
            assert back.dtype == want.dtype and back.shape == want.shape and torch.equal(_raw(back), _raw(want)), name
    got["f32"][0, 0] = 123.0  # views of the (writable) buffer, no copy
    assert codec.decode_tensors(blob)[0]["f32"][0, 0] == 123.0


def test_arrays_round_trip_and_foreign_files_decode():
    arrays = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "age": np.array([0, 1], dtype=np.int8),
              "x": np.float64(2.5) * np.ones(()), "cols": np.arange(6.0).reshape(2, 3).T}
    got, _ = codec.decode_arrays(_blob({n: codec.array_entry(n, a) for n, a in arrays.items()}))
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a), name
    foreign = safetensors.numpy.save({"a": np.arange(5, dtype=np.float32), "b": np.arange(3, dtype=np.int8)})
    assert np.array_equal(codec.decode_tensors(bytearray(foreign))[0]["a"].numpy(), np.arange(5, dtype=np.float32))
    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (1 - len(header) % 2)  # odd length: the data is not aligned
    unaligned = struct.pack("<Q", len(header)) + header + np.array([1.5, 2.5], np.float32).tobytes()
    assert codec.decode_tensors(bytearray(unaligned))[0]["x"].tolist() == [1.5, 2.5]


@pytest.mark.parametrize("blob, match", [
    (b"\x01\x00", "too short"),
    (struct.pack("<Q", 99) + b"{}", "exceeds the object"),
    (struct.pack("<Q", 4) + b"nope", "not JSON"),
    (struct.pack("<Q", 2) + b"[]", "not an object"),
    (struct.pack("<Q", 40) + b'{"x":{"dtype":"F32","shape":[2]}}       ', "malformed header entry"),
    (struct.pack("<Q", 64) + b'{"x":{"dtype":"F32","shape":[2],"data_offsets":["a","b"]}}      ', "malformed"),
    (struct.pack("<Q", 56) + b'{"x":{"dtype":"X99","shape":[2],"data_offsets":[0,8]}}  ', "malformed"),
    (struct.pack("<Q", 56) + b'{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}  ' + bytes(8),
     "do not fit shape"),
])
def test_malformed_objects_are_one_clear_error(blob, match):
    with pytest.raises(codec.FormatError, match=match):
        codec.decode_tensors(bytearray(blob))
