"""The byte-moving halves of Store (infra/storage/store.py): hash-while-writing and hash-while-reading for local
files and for S3 (s3fs), with no retries here (Store wraps every call in them)."""
from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

CHUNK_BYTES = 16 << 20  # granularity of S3 ranged reads and of buffers cut for writing
# s3fs uploads a body below 2 parts in one PUT (which carries its sha256), else in parts: every checkpoint shard
# (256 MiB at most) goes in one PUT; 200M-parameter state written 118 MB/s, 9 CPU-s, against 96 MB/s, 13 CPU-s
# in 50 MiB parts (bench/checkpoint.py, side by side)
PART_BYTES = 160 << 20
WRITE_BATCH_BYTES = 4 << 20  # hashed, then written while still in the CPU cache
IOV_BATCH = 512  # buffers per writev (Linux allows 1024)
MMAP_MIN_BYTES = 1 << 20  # below this a copy into a fresh buffer is cheaper than mapping the file


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


def chunks_of(buffers: Sequence, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """Flat byte views of `buffers`, large ones cut into `chunk_bytes` pieces; empty ones dropped."""
    out = []
    for buf in buffers:
        mv = memoryview(buf).cast("B")
        out.extend(mv[i:i + chunk_bytes] for i in range(0, len(mv), chunk_bytes))
    return out


def _batches(chunks: list[memoryview]) -> list[list[memoryview]]:
    """Consecutive chunks grouped into writev calls of at most WRITE_BATCH_BYTES and IOV_BATCH buffers, so a
    hundred small tensors cost one syscall while a batch stays small enough to be hashed and written while
    it is still in the CPU cache."""
    out: list[list[memoryview]] = [[]]
    size = 0
    for chunk in chunks:
        if out[-1] and (size + len(chunk) > WRITE_BATCH_BYTES or len(out[-1]) >= IOV_BATCH):
            out.append([])
            size = 0
        out[-1].append(chunk)
        size += len(chunk)
    return out


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def local_put(path: str, buffers: Sequence) -> ObjectInfo:
    """Write through a temp file renamed into place: a reader never sees half an object. Each batch of
    chunks is hashed, then written from the same (cache-warm) memory; the directory is made only when
    missing."""
    tmp, hasher = f"{path}.tmp-{uuid.uuid4().hex[:8]}", Hasher()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, flags, 0o666)
    try:
        try:
            for batch in _batches(chunks_of(buffers, WRITE_BATCH_BYTES)):
                for chunk in batch:
                    hasher.update(chunk)
                _writev_all(fd, batch)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return hasher.result()


def local_put_written(path: str, write: Callable[[str], None]) -> ObjectInfo:
    """`write(tmp_path)` makes the object (e.g. safetensors' save_file); it is hashed from the page cache
    (mapped, no copy) and renamed into place, so a reader never sees half an object."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        write(tmp)
        info = local_get(tmp, None)[1]
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return info


def new_buffer(size: int) -> memoryview:
    """A writable buffer for one object. (Not numpy.empty: it asks for transparent huge pages, and the
    kernel's compaction for those made reads 2-3x slower on a busy machine; the zero-fill is cheap.)"""
    return memoryview(bytearray(size))


def local_get(path: str, size: int | None) -> tuple[memoryview, ObjectInfo]:
    """The file's first `size` bytes (all when None), hashed. Objects from MMAP_MIN_BYTES on are mapped
    copy-on-write instead of copied (as safetensors' own loader does): hashing reads the page cache
    directly, so a verified load costs about one sha256 pass where a copy costs a read plus the pass; the
    view is writable (a write copies just that page and never reaches the file). Store never changes a file
    in place (temp file + rename; deleting a file leaves a mapping intact), so the bytes hashed are the bytes
    the caller sees. Another program truncating or rewriting the file in place while it is mapped would
    show through (truncation: SIGBUS on access); nothing in spillover does."""
    hasher = Hasher()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        length = os.fstat(fd).st_size
        length = min(length, size) if size is not None else length
        if length >= MMAP_MIN_BYTES:
            view = memoryview(mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE))
        else:
            view, got = new_buffer(length), 0
            while got < length:
                n = os.readv(fd, [view[got:]])
                if not n:  # shrank while read: the caller sees the size mismatch
                    view = view[:got]
                    break
                got += n
    finally:
        os.close(fd)
    hasher.update(view)
    return view, hasher.result()


def local_get_bytes(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def s3_put(fs, path: str, buffers: Sequence, timeout: CallTimeout, send_checksum: bool = True) -> ObjectInfo:
    """One contiguous bytes body (what botocore takes), joined in one copy without zero-filling first;
    s3fs uploads it in parallel parts when large.

    send_checksum: a single PUT carries the body's sha256 (x-amz-checksum-sha256, hashed here anyway), so the
    server refuses a body that differs. An attempt abandoned by its time limit can still reach the server
    later, after the retry that succeeded: SeaweedFS stores such a request that lost its body as an empty
    object (measured: headers queued at a paused server, client gone before the body). A multipart upload
    names its parts' ETags when it completes instead, and loading checks every object's sha256."""
    hasher, chunks = Hasher(), chunks_of(buffers)
    for chunk in chunks:
        hasher.update(chunk)
    info = hasher.result()
    body = buffers[0] if len(buffers) == 1 and isinstance(buffers[0], (bytes, bytearray)) else b"".join(chunks)
    extra = {}
    if send_checksum and len(body) < 2 * PART_BYTES:
        extra["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(info.sha256)).decode()
    fs.pipe_file(path, body, chunksize=PART_BYTES, timeout=timeout(len(body)), **extra)
    return info


def s3_get(fs, path: str, size: int | None, timeout: CallTimeout) -> tuple[memoryview, ObjectInfo]:
    """A view of one `bytes` object holding the object (what safetensors' load takes, without another copy),
    fetched by ranged GETs in parallel batches and hashed in order. An object shorter than `size` comes back
    short (the caller compares sizes), also when a range starts past its end (HTTP 416)."""
    if size is None:
        size = fs.info(path, timeout=timeout())["size"]
    try:
        return _s3_get_sized(fs, path, size, timeout)
    except OSError as err:
        if err.errno != errno.EINVAL:  # s3fs's errno for InvalidRange (and for other bad requests)
            raise
        actual = fs.info(path, timeout=timeout())["size"]
        if actual >= size:
            raise
        return _s3_get_sized(fs, path, actual, timeout)


def _s3_get_sized(fs, path: str, size: int, timeout: CallTimeout) -> tuple[memoryview, ObjectInfo]:
    hasher = Hasher()
    if size == 0:
        fs.info(path, timeout=timeout())  # still an error when it does not exist
        return memoryview(b""), hasher.result()
    if size <= CHUNK_BYTES:
        view = memoryview(fs.cat_file(path, start=0, end=size, timeout=timeout(size)))
        hasher.update(view)
        return view, hasher.result()
    parts = []
    starts = list(range(0, size, CHUNK_BYTES))
    batch = max(1, getattr(fs, "max_concurrency", 8))
    for i in range(0, len(starts), batch):
        group = starts[i:i + batch]
        datas = fs.cat_ranges([path] * len(group), group, [min(s + CHUNK_BYTES, size) for s in group],
                              on_error="raise", timeout=timeout(len(group) * CHUNK_BYTES))
        for start, data in zip(group, datas):
            hasher.update(memoryview(data))
            parts.append(data)
            if start + len(data) < min(start + CHUNK_BYTES, size):  # shorter than `size`
                return memoryview(b"".join(parts)), hasher.result()
    return memoryview(b"".join(parts)), hasher.result()


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
