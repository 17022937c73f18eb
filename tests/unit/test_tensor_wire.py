"""The torch engine's tensor encoding (rollout/sglang/tensor_wire.py) is safetensors as the safetensors library writes
and reads it, streamed in pieces no larger than CHUNK_BYTES; a blob whose header lies about its data is refused before
any tensor is made; the binary body's query carries SGLang's fields of /update_weights_from_tensor."""
from __future__ import annotations

import base64
import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import load as library_load
from safetensors.torch import save as library_save

from spillover.rollout.sglang import backend as sgl
from spillover.rollout.sglang.protocol import TensorUpdateFields
from spillover.rollout.sglang.tensor_wire import (CHUNK_BYTES, blob_size, decode_named_tensors, parse_safetensors,
                                                  safetensors_chunks)
from sglang_contract import check_payload


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    embed = torch.randn(5, 3)
    return [("model.embed_tokens.weight", embed), ("lm_head.weight", embed),  # tied: one storage, written twice
            ("norm.weight", torch.randn(3, dtype=torch.bfloat16)), ("ids", torch.arange(7)),
            ("columns", torch.randn(4, 6)[:, :3]), ("empty", torch.zeros(0, 4)), ("mask", torch.tensor([True, False]))]


def assert_same(got: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
    assert set(got) == {name for name, _ in named}
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_the_stream_is_a_safetensors_blob_both_ways():
    named = named_tensors()
    blob = b"".join(safetensors_chunks(named))
    assert len(blob) == blob_size(named)
    assert_same(library_load(blob), named)  # what the library reads
    assert_same(parse_safetensors(bytearray(library_save({n: t.clone() for n, t in named}))), named)  # what it writes
    assert_same(decode_named_tensors(base64.b64encode(blob).decode()), named)  # SGLang's JSON shape


def test_a_large_tensor_goes_in_pieces_and_is_not_copied_whole():
    big = torch.randn(CHUNK_BYTES // 4 * 2 + 5)
    pieces = list(safetensors_chunks([("big", big)]))
    assert [len(p) for p in pieces[1:]] == [CHUNK_BYTES, CHUNK_BYTES, 20]
    assert torch.equal(parse_safetensors(bytearray(b"".join(pieces)))["big"], big)


def test_parsed_tensors_view_the_blob():
    blob = bytearray(b"".join(safetensors_chunks([("w", torch.ones(4))])))
    tensor = parse_safetensors(blob)["w"]
    blob[-4:] = struct.pack("<f", 7.0)
    assert tensor[-1].item() == 7.0


def blob_with_header(header: dict, data: bytes) -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("blob, match", [
    (bytearray(b"\x01\x02"), "too few"),
    (bytearray(struct.pack("<Q", 10**9) + b"{}"), "header length"),
    (blob_with_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8 bytes"),
    (blob_with_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "starts at byte 4"),
    (blob_with_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "holds 8"),
    (blob_with_header({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "dtype 'C64'"),
    (blob_with_header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "shape"),
    (blob_with_header({"w": [1, 2]}, b""), "no dtype/shape/data_offsets"),
    (blob_with_header({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "dtype"),
    (bytearray(struct.pack("<Q", 20000) + b"[" * 20000), "not JSON"),
    (bytearray(pickle.dumps([("w", torch.ones(2))])), "safetensors"),
])
def test_a_blob_that_is_not_safetensors_is_refused(blob, match):
    with pytest.raises(ValueError, match=match):
        parse_safetensors(blob)


def test_repeated_names_and_unknown_dtypes_are_refused_before_sending():
    with pytest.raises(ValueError, match="appear twice"):
        list(safetensors_chunks([("w", torch.ones(1)), ("w", torch.ones(1))]))
    with pytest.raises(ValueError, match="complex64"):
        list(safetensors_chunks([("w", torch.ones(1, dtype=torch.complex64))]))


@pytest.mark.parametrize("version, flush_cache", [(None, False), (3, True), ("7", False)])
def test_the_binary_query_carries_sglangs_fields(version, flush_cache):
    """The query of the binary body is UpdateWeightsFromTensorReqInput's fields besides the tensors, as text."""
    query = TensorUpdateFields(weight_version=version, flush_cache=flush_cache).query()
    assert query == {"flush_cache": str(flush_cache).lower(), "abort_all_requests": "false", "selector": "all",
                     **({} if version is None else {"weight_version": str(version)})}
    check_payload(sgl.ENDPOINTS["update_from_tensor"], {"serialized_named_tensors": ["x"], **query})
