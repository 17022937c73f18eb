"""The torch engine's encoding of the tensors of `/update_weights_from_tensor`: safetensors, written and read here.

SGLang's `serialized_named_tensors` entries are pickles (torch's ForkingPickler: CUDA IPC handles, unpickled through an
allow-list) that only a process on the same GPU node can use. The torch engine runs on CPU and unpickles nothing: it
takes the tensors' data as one safetensors blob (format: 8-byte little-endian header length, JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes), in either of two bodies:

- SGLang's request shape (JSON, one base64 entry per TP rank): `encode_named_tensors` / `decode_named_tensors`.
  Base64 inside JSON costs tens of seconds per GB on these CPUs (encoding, parsing and validating 100 MB strings).
- the binary body (`SAFETENSORS_MEDIA_TYPE`, the request's other fields as query parameters): `safetensors_chunks`
  streams the blob tensor by tensor without building it, the engine reads it into one buffer and `parse_safetensors`
  views the tensors in place. WeightPoster sends this to torch engines; SGLang engines get SGLang's JSON.

`spillover.rollout.sglang.backend.serialize_named_tensors` picks the JSON entries' encoding by backend.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Iterable, Iterator

import torch

__all__ = ["SAFETENSORS_MEDIA_TYPE", "blob_size", "decode_named_tensors", "encode_named_tensors",
           "parse_safetensors", "safetensors_chunks"]

SAFETENSORS_MEDIA_TYPE = "application/x-safetensors"
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
CHUNK_BYTES = 2**20  # pieces the HTTP client copies once each: larger ones cost it a page fault per 4 KiB sent
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def blob_order(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] checked for repeated names, dtypes safetensors can hold and the order the blob keeps: wider
    elements first, so every tensor's data starts aligned to its element size (the header is padded to 8 bytes)."""
    named = list(named_tensors)
    names = [name for name, _ in named]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"serialized_named_tensors: tensors {repeated} appear twice")
    unknown = sorted({str(t.dtype) for _, t in named if t.dtype not in DTYPE_CODES})
    if unknown:
        raise ValueError(f"serialized_named_tensors: dtypes {unknown} have no safetensors code here; use one of "
                         f"{sorted(str(d) for d in DTYPE_CODES)}")
    return sorted(named, key=lambda item: -item[1].element_size())


def header_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """The blob's first part: its header's length (u64, little-endian) and the JSON header, padded with spaces to 8
    bytes as safetensors pads it."""
    entries, offset = {}, 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def blob_size(named_tensors: NamedTensors) -> int:
    """Bytes of the safetensors blob of these tensors (the binary body's Content-Length)."""
    named = blob_order(named_tensors)
    return len(header_bytes(named)) + sum(t.numel() * t.element_size() for _, t in named)


def safetensors_chunks(named_tensors: NamedTensors) -> Iterator[memoryview]:
    """The safetensors blob of [(name, tensor)] as pieces to send one after another: the header, then each tensor's
    bytes (one tensor at a time on the CPU, never the whole blob). Tensors sharing storage, e.g. tied embeddings, are
    each written whole."""
    named = blob_order(named_tensors)
    yield memoryview(header_bytes(named))
    for _, tensor in named:
        if tensor.numel():
            data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), CHUNK_BYTES):
                yield data[start:start + CHUNK_BYTES]


def encode_named_tensors(named_tensors: NamedTensors) -> str:
    """[(name, tensor)] -> base64 text of their safetensors blob (one JSON entry of SGLang's request shape)."""
    return base64.b64encode(b"".join(safetensors_chunks(named_tensors))).decode("ascii")


def decode_named_tensors(entry: str | bytes) -> dict[str, torch.Tensor]:
    """One JSON entry (base64 text of a safetensors blob) -> {name: CPU tensor}. Anything else raises ValueError
    naming the expected encoding (a pickle, SGLang's own encoding, is refused, never unpickled)."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError("serialized_named_tensors: the torch engine takes each entry as base64 text of a safetensors "
                         "blob (spillover.rollout.sglang.backend.serialize_named_tensors(..., backend='torch')), not "
                         f"SGLang's CUDA IPC pickle: {err}") from err
    return parse_safetensors(bytearray(raw))


NOT_SAFETENSORS = ("not a safetensors blob (the torch engine reads tensors as safetensors, never SGLang's CUDA IPC "
                   "pickles)")


def parse_safetensors(blob: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """A safetensors blob -> {name: CPU tensor viewing `blob` (no copy: keep blob alive, and unchanged, while they
    are used)}. The header is checked before any tensor is made: known dtypes, sizes that match the shapes, data that
    covers the rest of the blob exactly. Anything else raises ValueError."""
    if len(blob) < 8:
        raise ValueError(f"{NOT_SAFETENSORS}: {len(blob)} bytes are too few for its header")
    (header_len,) = struct.unpack_from("<Q", blob)
    if header_len > min(MAX_HEADER_BYTES, len(blob) - 8):
        raise ValueError(f"{NOT_SAFETENSORS}: the header length {header_len} does not fit the {len(blob)}-byte blob")
    try:
        header = json.loads(bytes(blob[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{NOT_SAFETENSORS}: the header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{NOT_SAFETENSORS}: the header is not a JSON object")
    start = 8 + header_len
    entries = sorted(((name, tensor_entry(name, spec)) for name, spec in header.items() if name != "__metadata__"),
                     key=lambda item: item[1][2])
    covered = 0
    for name, (_, _, begin, end) in entries:
        if begin != covered:
            raise ValueError(f"safetensors blob: tensor {name!r} starts at byte {begin}, expected {covered} "
                             "(the data must be contiguous, without gaps or overlaps)")
        covered = end
    if start + covered != len(blob):
        raise ValueError(f"safetensors blob: the tensors' data takes {covered} bytes, the blob holds "
                         f"{len(blob) - start} after the header")
    return {name: tensor_view(blob, start + begin, dtype, shape) for name, (dtype, shape, begin, _) in entries}


def tensor_entry(name: str, spec) -> tuple[torch.dtype, list[int], int, int]:
    """One header entry -> (dtype, shape, begin, end), checked: a known dtype, a shape of non-negative ints, data
    offsets whose span is the shape's size in bytes."""
    if not (isinstance(spec, dict) and isinstance(spec.get("shape"), list)
            and isinstance(spec.get("data_offsets"), list)):
        raise ValueError(f"safetensors blob: tensor {name!r} has no dtype/shape/data_offsets entry")
    code = spec.get("dtype")
    dtype = CODE_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise ValueError(f"safetensors blob: tensor {name!r} has dtype {spec.get('dtype')!r}; this engine reads "
                         f"{sorted(CODE_DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if (not all(type(n) is int and n >= 0 for n in shape) or len(offsets) != 2
            or not all(type(n) is int for n in offsets)):
        raise ValueError(f"safetensors blob: tensor {name!r} has shape {shape} and data_offsets {offsets}")
    begin, end = offsets
    size = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != size:
        raise ValueError(f"safetensors blob: tensor {name!r} of shape {shape} ({spec['dtype']}) needs {size} bytes; "
                         f"its data_offsets {offsets} span {end - begin}")
    return dtype, shape, begin, end


def tensor_view(blob: bytearray | memoryview, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)
