"""A checkpoint's tensor and array objects: safetensors files written and read by the `safetensors` library.

On file:// an object from 1 MiB on is written by `save_file` (straight from tensor memory, into a temp file
renamed into place) and hashed from the page cache; it is loaded by `safe_open`, which maps the file
copy-on-write (no copy; each tensor has storage of its own bytes; writing to one never reaches the file),
after its sha256 matched the manifest. Smaller objects, and every object on S3, are `save`d to bytes and
written, and read, hashed and `load`ed from bytes (for a small object one open beats two).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from .errors import StorageError
from .store import ObjectInfo, ObjectMissing, Store
from .hashed_io import MMAP_MIN_BYTES as MAP_MIN_BYTES

TENSORS, ARRAYS = "tensors", "arrays"
_FRAMEWORK = {TENSORS: "pt", ARRAYS: "numpy"}


class ObjectFormatError(ValueError):
    """Values that cannot be stored in safetensors, or an object that is not valid safetensors."""


def tensors_for_save(group: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, CPU, contiguous tensors; one whose bytes overlap another's (e.g. tied embeddings) gets a copy
    of its own, as safetensors stores every tensor's bytes once."""
    out, spans = {}, {}  # spans: storage address -> [(start, end) of the tensors kept on it]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ObjectFormatError(f"{group}.{name} is a {type(t).__name__}, not a tensor")
        if t.requires_grad or not t.is_cpu or not t.is_contiguous():
            t = t.detach().cpu().contiguous()
        if t.numel():
            start = t.data_ptr()
            end = start + t.nbytes
            if any(s < end and start < e for s, e in spans.get(t.untyped_storage().data_ptr(), ())):
                t = t.clone()
                start, end = t.data_ptr(), t.data_ptr() + t.nbytes
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, end))
        out[name] = t
    return out


def arrays_for_save(group: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind not in "biuf":
            raise ObjectFormatError(f"array {group}.{name}: dtype {a.dtype} cannot be stored (numbers and bools "
                                    "only; encode strings as token ids or put them in meta)")
        out[name] = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
    return out


def nbytes(value) -> int:
    return value.nbytes if isinstance(value, (torch.Tensor, np.ndarray)) else 0


def split_shards(values: dict, max_bytes: int) -> list[dict]:
    """Greedy split (by name) into shards of at most `max_bytes` of data; a bigger value gets its own shard."""
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(values):
        n = nbytes(values[name])
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = values[name]
        size += n
    return shards


def object_bytes(kind: str, values: dict) -> bytes:
    """The object as bytes (what goes to S3)."""
    lib = safetensors.torch if kind == TENSORS else safetensors.numpy
    try:
        return lib.save(values)
    except (SafetensorError, ValueError, TypeError, RuntimeError) as err:
        raise ObjectFormatError(f"{kind} cannot be stored in safetensors: {err}") from None


def put_object(store: Store, key: str, kind: str, values: dict) -> ObjectInfo:
    """Write one object; returns its size and sha256."""
    if not store.is_local or sum(nbytes(v) for v in values.values()) < MAP_MIN_BYTES:
        return store.put_bytes(key, object_bytes(kind, values))  # (small: one write, hashed on the way)
    lib = safetensors.torch if kind == TENSORS else safetensors.numpy
    refused: list[ObjectFormatError] = []

    def write(path: str) -> None:
        try:
            lib.save_file(values, path)
        except (SafetensorError, ValueError, TypeError, RuntimeError) as err:
            refused.append(ObjectFormatError(f"{kind} cannot be stored in safetensors: {err}"))
            raise refused[-1] from None
    try:
        return store.put_written(key, write)
    except StorageError:
        if refused:  # the values, not the storage: the store's retry wraps every error of the write as its own
            raise refused[-1] from None
        raise


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_object(store: Store, key: str, kind: str | None, size: int,
                verify: Callable[[ObjectInfo], None]) -> dict | memoryview:
    """The object, once `verify` accepted its size and sha256: a dict of tensors/arrays for `kind`, or the raw
    buffer when kind is None. Raises ObjectMissing, ObjectFormatError, or what `verify` raises."""
    if kind is None or not store.is_local or size < MAP_MIN_BYTES:
        buf, info = store.get_buffer(key, size=size)
        verify(info)
        if kind is None:
            return buf
        lib = safetensors.torch if kind == TENSORS else safetensors.numpy
        try:
            whole = buf.obj if isinstance(buf.obj, bytes) and len(buf.obj) == len(buf) else bytes(buf)
            return lib.load(whole)  # (S3 hands over its bytes object: no copy here)
        except (SafetensorError, ValueError, TypeError, RuntimeError) as err:
            raise ObjectFormatError(f"not a valid safetensors object: {err}") from None
    path = store.path(key)
    try:
        before = _identity(path)
    except FileNotFoundError:
        raise ObjectMissing(f"read {store.key_url(key)} failed, it does not exist") from None
    verify(store.get_buffer(key, size=size)[1])  # hashed from the page cache (mapped, no copy)
    try:
        with safe_open(path, framework=_FRAMEWORK[kind]) as f:
            out = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, ValueError, TypeError, RuntimeError) as err:
        raise ObjectFormatError(f"not a valid safetensors object: {err}") from None
    if _identity(path) != before:  # Store replaces files, never changes one in place: same inode, same bytes
        raise ObjectFormatError("the file was replaced while it was loaded")
    return out
