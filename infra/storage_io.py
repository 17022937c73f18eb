"""The byte-moving halves of Store (infra/storage.py): hash-while-writing and hash-while-reading for local
files and for S3 (s3fs), with no retries here (Store wraps every call in them)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from dataclasses import dataclass
from typing import Sequence

CHUNK_BYTES = 16 << 20  # hashing/reading granularity


@dataclass(frozen=True)
class CallTimeout:
    """Longest one s3fs call may take: base_s, plus time for the bytes it moves at min_mb_s. botocore's
    read timeout alone does not bound a call: a request body sent to a hung server blocks forever."""
    base_s: float
    min_mb_s: float = 8.0

    def __call__(self, nbytes: int = 0) -> float:
        return self.base_s + nbytes / (self.min_mb_s * 1e6)


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256: str


class Hasher:
    """sha256 and size of the chunks of one object, fed in order on the thread moving its bytes (hashlib
    releases the GIL; objects are moved on several threads, so hashing runs on all cores)."""

    def __init__(self):
        self._hash = hashlib.sha256()
        self.size = 0

    def update(self, chunk: memoryview) -> None:
        self.size += len(chunk)
        self._hash.update(chunk)

    def result(self) -> ObjectInfo:
        return ObjectInfo(self.size, self._hash.hexdigest())


def chunks_of(buffers: Sequence) -> list[memoryview]:
    out = []
    for buf in buffers:
        mv = memoryview(buf).cast("B")
        out.extend(mv[i:i + CHUNK_BYTES] for i in range(0, len(mv), CHUNK_BYTES))
    return out


def local_put(path: str, chunks: list[memoryview]) -> ObjectInfo:
    """Write through a temp file renamed into place: a reader never sees half an object."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp, hasher = f"{path}.tmp-{uuid.uuid4().hex[:8]}", Hasher()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                hasher.update(chunk)
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return hasher.result()


def new_buffer(size: int) -> memoryview:
    """A writable buffer for one object. (Not numpy.empty: it asks for transparent huge pages, and the
    kernel's compaction for those made reads 2-3x slower on a busy machine; the zero-fill is cheap.)"""
    return memoryview(bytearray(size))


def local_get(path: str, size: int | None) -> tuple[memoryview, ObjectInfo]:
    with open(path, "rb") as f:
        size = min(os.fstat(f.fileno()).st_size, size if size is not None else 1 << 62)
        hasher, view = Hasher(), new_buffer(size)
        for start in range(0, size, CHUNK_BYTES):
            chunk = view[start:start + CHUNK_BYTES]
            got = f.readinto(chunk)
            hasher.update(chunk[:got])
            if got < len(chunk):  # shrank while read: the caller sees the size mismatch
                return view[:hasher.size], hasher.result()
    return view, hasher.result()


def s3_put(fs, path: str, buffers: Sequence, chunks: list[memoryview], timeout: CallTimeout) -> ObjectInfo:
    """One contiguous bytes body (what botocore takes), joined in one copy without zero-filling first;
    s3fs uploads it in parallel parts when large."""
    hasher = Hasher()
    for chunk in chunks:
        hasher.update(chunk)
    body = buffers[0] if len(buffers) == 1 and isinstance(buffers[0], (bytes, bytearray)) else b"".join(chunks)
    fs.pipe_file(path, body, timeout=timeout(len(body)))
    return hasher.result()


def s3_get(fs, path: str, size: int | None, timeout: CallTimeout) -> tuple[memoryview, ObjectInfo]:
    """Ranged GETs in parallel batches into one writable buffer, hashed in order."""
    if size is None:
        size = fs.info(path, timeout=timeout())["size"]
    hasher = Hasher()
    if size == 0:
        fs.info(path, timeout=timeout())  # still an error when it does not exist
        return new_buffer(0), hasher.result()
    if size <= CHUNK_BYTES:
        view = memoryview(bytearray(fs.cat_file(path, start=0, end=size, timeout=timeout(size))))
        hasher.update(view)
        return view, hasher.result()
    view = new_buffer(size)
    starts = list(range(0, size, CHUNK_BYTES))
    batch = max(1, getattr(fs, "max_concurrency", 8))
    for i in range(0, len(starts), batch):
        group = starts[i:i + batch]
        datas = fs.cat_ranges([path] * len(group), group, [min(s + CHUNK_BYTES, size) for s in group],
                              on_error="raise", timeout=timeout(len(group) * CHUNK_BYTES))
        for start, data in zip(group, datas):
            view[start:start + len(data)] = data
            hasher.update(view[start:start + len(data)])
            if start + len(data) < min(start + CHUNK_BYTES, size):  # shorter than `size`
                return view[:hasher.size], hasher.result()
    return view, hasher.result()


def s3_delete(fs, path: str, timeout: CallTimeout) -> None:
    """Delete an object or prefix, and the 'directory' markers SeaweedFS keeps listing otherwise."""
    try:
        found = fs.find(path, withdirs=True, detail=True, timeout=timeout())
    except FileNotFoundError:
        found = {}
    markers = [p for p, d in found.items() if d.get("type") == "directory"]
    if any(p.rstrip("/") != path for p in found):
        markers.append(path)
    try:
        fs.rm(path, recursive=True, timeout=timeout())
    except FileNotFoundError:
        pass
    for marker in sorted(set(markers), key=lambda p: -p.count("/")):  # deepest first
        bucket, _, prefix = marker.partition("/")
        if prefix:
            fs.call_s3("delete_object", Bucket=bucket, Key=prefix.rstrip("/") + "/", timeout=timeout())
