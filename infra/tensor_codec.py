"""The safetensors format, written straight from tensor/array memory and read into views of one buffer.

Why not `safetensors.torch.save`: it builds one more full copy of the bytes before we can hash and write
them. Here `encode` returns [header, tensor memory, ...] for a hashing writer, and `decode_*` returns
tensors/arrays that view the (writable) buffer the object was read into. The bytes are standard
safetensors (the tests load them with the official library and back).

Layout: u64 little-endian header length N, N bytes of JSON header (space padded to 8 bytes), then the data
of each tensor, in order of decreasing element size so every tensor stays aligned.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Iterable

import numpy as np
import torch

_TORCH = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_TORCH_BACK = {v: k for k, v in _TORCH.items()}
_NUMPY = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
          np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL", np.dtype(np.uint16): "U16",
          np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64"}
_NUMPY_BACK = {v: k for k, v in _NUMPY.items()}
_RAW = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class FormatError(ValueError):
    """Bytes that are not a valid safetensors object (or values that cannot become one)."""


Entry = tuple[str, tuple[int, ...], memoryview]  # (dtype code, shape, raw bytes)


def tensor_entry(name: str, t: torch.Tensor) -> Entry:
    code = _TORCH.get(t.dtype)
    if code is None:
        raise FormatError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
    if t.requires_grad or not t.is_cpu or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    shape = tuple(t.shape)
    if not t.numel():
        return code, shape, memoryview(b"")
    if code not in _NUMPY_BACK:  # bf16/fp8: no numpy dtype; their raw bytes
        t = t.reshape(-1).view(torch.uint8)
    return code, shape, memoryview(t.numpy()).cast("B")


def array_entry(name: str, a: np.ndarray) -> Entry:
    a = np.asarray(a)
    if a.dtype not in _NUMPY:
        raise FormatError(f"array {name!r}: dtype {a.dtype} cannot be stored (numbers and bools only; encode "
                          "strings as token ids or put them in meta)")
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    return _NUMPY[a.dtype], tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8)).cast("B")


def encode(entries: dict[str, Entry], metadata: dict[str, str] | None = None) -> list[memoryview | bytes]:
    """[header bytes, data of each entry...]: the concatenation is one safetensors object."""
    order = sorted(entries, key=lambda n: (-_ITEMSIZE[entries[n][0]], n))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        code, shape, raw = entries[name]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text] + [entries[n][2] for n in order if len(entries[n][2])]


def encoded_size(entries: Iterable[Entry]) -> int:
    return sum(len(raw) for _, _, raw in entries)


def _parse(buf) -> tuple[list[tuple[str, str, tuple[int, ...], int]], dict[str, str]]:
    """Validated header: [(name, dtype code, shape, absolute offset of the data)], and the metadata."""
    if len(buf) < 8:
        raise FormatError(f"object of {len(buf)} bytes is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8:
        raise FormatError(f"header length {n} exceeds the object ({len(buf)} bytes)")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except ValueError as err:
        raise FormatError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise FormatError(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    base, data_len, out = 8 + n, len(buf) - 8 - n, []
    for name, spec in header.items():
        try:
            code, shape, (begin, end) = spec["dtype"], tuple(map(int, spec["shape"])), map(int, spec["data_offsets"])
            itemsize = _ITEMSIZE[code]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"tensor {name!r}: malformed header entry {spec!r}") from None
        if any(d < 0 for d in shape) or not (0 <= begin <= end <= data_len) \
                or end - begin != math.prod(shape) * itemsize:
            raise FormatError(f"tensor {name!r}: data_offsets {[begin, end]} do not fit shape {list(shape)} "
                              f"{code} within {data_len} data bytes")
        out.append((name, code, shape, base + begin))
    return out, metadata


def _ndarray(buf, np_dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """An array viewing buf[offset:] (the cheapest view numpy makes: ~1 us, which counts at 100s of tensors)."""
    return np.ndarray(shape, np_dtype, buf, offset)


def decode_tensors(buf) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors viewing `buf` (any bytes-like; no copy, writable when buf is), and the header metadata. Each
    tensor has storage of its own bytes only (pickling one, e.g. to a Ray actor, sends just those)."""
    entries, metadata = _parse(buf)
    out = {}
    for name, code, shape, offset in entries:
        dtype = _TORCH_BACK.get(code)
        if dtype is None:
            raise FormatError(f"tensor {name!r}: dtype {code} has no torch equivalent here")
        if not math.prod(shape):
            out[name] = torch.empty(shape, dtype=dtype)
        elif code in _NUMPY_BACK:
            out[name] = torch.from_numpy(_ndarray(buf, _NUMPY_BACK[code], shape, offset))
        else:  # bf16/fp8: no numpy dtype; view the raw bytes
            raw = _ndarray(buf, _RAW[_ITEMSIZE[code]], shape, offset)
            out[name] = torch.from_numpy(raw).view(dtype)
    return out, metadata


def decode_arrays(buf) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """numpy arrays viewing `buf` (no copy), and the header metadata."""
    entries, metadata = _parse(buf)
    out = {}
    for name, code, shape, offset in entries:
        if code not in _NUMPY_BACK:
            raise FormatError(f"array {name!r}: dtype {code} has no numpy equivalent")
        out[name] = _ndarray(buf, _NUMPY_BACK[code], shape, offset)
    return out, metadata


def split_shards(entries: dict[str, Entry], max_bytes: int) -> list[dict[str, Entry]]:
    """Greedy split into shards of at most `max_bytes` of data (a bigger tensor gets a shard of its own)."""
    shards: list[dict[str, Entry]] = [{}]
    size = 0
    for name in sorted(entries):
        n = len(entries[name][2])
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = entries[name]
        size += n
    return shards
