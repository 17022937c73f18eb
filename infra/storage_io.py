"""The byte-moving halves of Store (infra/storage.py): hash-while-writing and hash-while-reading for local
files and for S3 (s3fs), with no retries here (Store wraps every call in them)."""
from __future__ import annotations

import hashlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

CHUNK_BYTES = 16 << 20  # hashing/reading granularity


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256: str


class OrderedHasher:
    """sha256 over chunks fed in order. With a (single-thread) pool the hashing runs there (hashlib releases
    the GIL), overlapping the I/O of the next chunk; without one it runs inline (small objects)."""

    def __init__(self, pool: ThreadPoolExecutor | None):
        self._hash = hashlib.sha256()
        self._pool = pool
        self._pending: list = []
        self.size = 0

    def update(self, chunk: memoryview) -> None:
        self.size += len(chunk)
        if self._pool is None:
            self._hash.update(chunk)
            return
        self._pending.append(self._pool.submit(self._hash.update, chunk))
        if len(self._pending) > 4:  # bound the memory pinned by queued chunks
            self._pending.pop(0).result()

    def result(self) -> ObjectInfo:
        for fut in self._pending:
            fut.result()
        return ObjectInfo(self.size, self._hash.hexdigest())


MakeHasher = Callable[[int], OrderedHasher]  # object size -> hasher


def chunks_of(buffers: Sequence) -> list[memoryview]:
    out = []
    for buf in buffers:
        mv = memoryview(buf).cast("B")
        out.extend(mv[i:i + CHUNK_BYTES] for i in range(0, len(mv), CHUNK_BYTES))
    return out


def local_put(path: str, chunks: list[memoryview], hasher: OrderedHasher) -> ObjectInfo:
    """Write through a temp file renamed into place: a reader never sees half an object."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                hasher.update(chunk)
                f.write(chunk)
        info = hasher.result()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return info


def local_get(path: str, size: int | None, make_hasher: MakeHasher) -> tuple[bytearray, ObjectInfo]:
    with open(path, "rb") as f:
        size = min(os.fstat(f.fileno()).st_size, size if size is not None else 1 << 62)
        hasher = make_hasher(size)
        buf = bytearray(size)
        view = memoryview(buf)
        for start in range(0, size, CHUNK_BYTES):
            chunk = view[start:start + CHUNK_BYTES]
            got = f.readinto(chunk)
            hasher.update(chunk[:got])
            if got < len(chunk):  # shrank while read: the caller sees the size mismatch
                return buf[:hasher.size], hasher.result()
    return buf, hasher.result()


def s3_put(fs, path: str, buffers: Sequence, chunks: list[memoryview], hasher: OrderedHasher) -> ObjectInfo:
    """One contiguous body (botocore wants bytes-like), filled chunk by chunk while the previous chunk is
    hashed; s3fs uploads it in parallel parts when large."""
    if len(buffers) == 1 and isinstance(buffers[0], (bytes, bytearray)):
        body = buffers[0]
        for chunk in chunks:
            hasher.update(chunk)
    else:
        body = bytearray(sum(len(c) for c in chunks))
        view, offset = memoryview(body), 0
        for chunk in chunks:
            view[offset:offset + len(chunk)] = chunk
            hasher.update(view[offset:offset + len(chunk)])
            offset += len(chunk)
    info = hasher.result()
    fs.pipe_file(path, body)
    return info


def s3_get(fs, path: str, size: int | None, make_hasher: MakeHasher) -> tuple[bytearray, ObjectInfo]:
    """Ranged GETs in parallel batches into one writable buffer, hashed in order."""
    if size is None:
        size = fs.info(path)["size"]
    hasher = make_hasher(size)
    if size == 0:
        fs.info(path)  # still an error when it does not exist
        return bytearray(), hasher.result()
    if size <= CHUNK_BYTES:
        buf = bytearray(fs.cat_file(path, start=0, end=size))
        hasher.update(memoryview(buf))
        return buf, hasher.result()
    buf = bytearray(size)
    view = memoryview(buf)
    starts = list(range(0, size, CHUNK_BYTES))
    batch = max(1, getattr(fs, "max_concurrency", 8))
    for i in range(0, len(starts), batch):
        group = starts[i:i + batch]
        datas = fs.cat_ranges([path] * len(group), group, [min(s + CHUNK_BYTES, size) for s in group],
                              on_error="raise")
        for start, data in zip(group, datas):
            view[start:start + len(data)] = data
            hasher.update(view[start:start + len(data)])
            if start + len(data) < min(start + CHUNK_BYTES, size):  # shorter than `size`
                return buf[:hasher.size], hasher.result()
    return buf, hasher.result()


def s3_delete(fs, path: str) -> None:
    """Delete an object or prefix, and the 'directory' markers SeaweedFS keeps listing otherwise."""
    try:
        found = fs.find(path, withdirs=True, detail=True)
    except FileNotFoundError:
        found = {}
    markers = [p for p, d in found.items() if d.get("type") == "directory"]
    if any(p.rstrip("/") != path for p in found):
        markers.append(path)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    for marker in sorted(set(markers), key=lambda p: -p.count("/")):  # deepest first
        bucket, _, prefix = marker.partition("/")
        if prefix:
            fs.call_s3("delete_object", Bucket=bucket, Key=prefix.rstrip("/") + "/")
