"""Object storage behind one small interface: `open_store(url, cfg) -> Store`.

A URL is a plain path, `file:///abs/path`, or `s3://bucket/prefix` (s3fs; endpoint, region and credentials
from StorageConfig or the standard AWS_* environment variables). Every call retries transient errors
(connection refused, timeouts, 5xx) with exponential backoff under a total deadline. Credentials are never
part of a URL, repr, log line or error message. File writes are atomic (temp file + rename); an S3 upload
carries its sha256, so the server refuses a body that differs (storage_io.s3_put).
"""
from __future__ import annotations

import functools
import hashlib
import os
import uuid
from typing import Callable, Sequence
from urllib.parse import urlsplit

from fsspec.implementations.local import LocalFileSystem

from ..config.run_config import StorageConfig
from .errors import (Fixes, ObjectMissing, Redactor, RetryPolicy, StorageAuthError, StorageError,
                     StorageUnreachable, log, with_retries)
from .hashed_io import (CallTimeout, ObjectInfo, local_get, local_get_bytes, local_put, local_put_written, s3_delete,
                        s3_get, s3_put)

__all__ = ["Store", "ObjectInfo", "open_store", "check_storage", "s3_server", "StorageError", "StorageAuthError",
           "StorageUnreachable", "ObjectMissing", "RetryPolicy"]

def _plain_url(url: str) -> str:
    """The URL without user:password@ (never echo credentials a user pasted into a URL)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return url.replace(parts.netloc, parts.hostname or "", 1)
    return url


class Store:
    """An fsspec filesystem and a root; keys are '/'-separated paths below the root."""

    def __init__(self, fs, root: str, url: str, redact: Redactor, retry: RetryPolicy, fixes: Fixes,
                 timeout: CallTimeout | None = None, send_checksums: bool = True):
        self.fs, self.root, self.url, self.retry, self.timeout = fs, root.rstrip("/"), url, retry, timeout
        self.send_checksums = send_checksums
        self._redact, self._fixes = redact, fixes
        self.is_local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def path(self, key: str = "") -> str:
        return f"{self.root}/{key.strip('/')}" if key.strip("/") else self.root

    def key_url(self, key: str = "") -> str:
        return f"{self.url.rstrip('/')}/{key.strip('/')}" if key else self.url

    def contains_secret(self, text: str) -> bool:
        return self._redact.contains_secret(text)

    def _retry(self, what: str, key: str, fn):
        return with_retries(fn, what=what, url=self.key_url(key), policy=self.retry, redact=self._redact,
                            fixes=self._fixes)

    # ---- writes
    def put_buffers(self, key: str, buffers: Sequence) -> ObjectInfo:
        """Write the concatenation of `buffers` (bytes-like, e.g. numpy/tensor memory) as one object,
        hashing while writing. Returns its size and sha256."""
        return self._retry("write", key, lambda: self._put_once(key, buffers))

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        return self.put_buffers(key, [data])

    def put_written(self, key: str, write: Callable[[str], None]) -> ObjectInfo:
        """Local stores only: `write(path)` writes the object to a temporary path (hashed, then renamed into
        place), e.g. a library's save_file writing straight from tensor memory."""
        if not self.is_local:
            raise StorageError(f"{self.url} is not a local store; use put_bytes")
        return self._retry("write", key, lambda: local_put_written(self.path(key), write))

    def _put_once(self, key: str, buffers: Sequence) -> ObjectInfo:
        if self.is_local:
            return local_put(self.path(key), buffers)
        return s3_put(self.fs, self.path(key), buffers, self.timeout, self.send_checksums)

    # ---- reads
    def _kw(self) -> dict:
        """Extra arguments of a small s3fs call: its time limit (local calls take none)."""
        return {} if self.is_local else {"timeout": self.timeout()}

    def get_bytes(self, key: str) -> bytes:
        if self.is_local:
            return self._retry("read", key, lambda: local_get_bytes(self.path(key)))
        return self._retry("read", key, lambda: self.fs.cat_file(self.path(key), **self._kw()))

    def get_buffer(self, key: str, size: int | None = None) -> tuple[memoryview, ObjectInfo]:
        """The object's bytes, hashed while read: locally a private (writable) mapping or copy, on S3 a view of
        one `bytes` object. With `size` (e.g. from a manifest) at most that many bytes are read: compare the
        returned size."""
        return self._retry("read", key, lambda: self._get_once(key, size))

    def get_file(self, key: str, local_path: str, chunk_bytes: int = 16 * 2**20) -> str:
        """Copy the object to local_path chunk by chunk (memory: one chunk, for multi-GB objects) -> its sha256."""
        def copy() -> str:
            digest = hashlib.sha256()
            with self.fs.open(self.path(key), "rb", block_size=chunk_bytes) as src, open(local_path, "wb") as dst:
                while chunk := src.read(chunk_bytes):
                    digest.update(chunk)
                    dst.write(chunk)
            return digest.hexdigest()
        return self._retry("read", key, copy)

    def _get_once(self, key: str, size: int | None) -> tuple[memoryview, ObjectInfo]:
        if self.is_local:
            return local_get(self.path(key), size)
        return s3_get(self.fs, self.path(key), size, self.timeout)

    # ---- listing and deletion
    def exists(self, key: str) -> bool:
        return self._retry("check", key, lambda: self.fs.exists(self.path(key), **self._kw()))

    def info(self, key: str) -> dict:
        """The object's metadata as fsspec gives it: name, size, type (file or directory); on S3 also ETag."""
        return self._retry("check", key, lambda: self.fs.info(self.path(key), **self._kw()))

    def list(self, prefix: str = "") -> list[str]:
        """Names of the direct children (objects and 'directories') under `prefix`; [] if none."""
        def ls():
            try:
                extra = {} if self.is_local else {"refresh": True, **self._kw()}
                entries = self.fs.ls(self.path(prefix), detail=False, **extra)
            except FileNotFoundError:
                return []
            here = self.path(prefix).rstrip("/")
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != here})
        return self._retry("list", prefix, ls)

    def list_all(self) -> list[str]:
        """Every object below the root (recursively), as keys relative to it; [] if none."""
        def find():
            try:
                found = self.fs.find(self.root, **({} if self.is_local else self._kw()))
            except FileNotFoundError:
                return []
            return sorted(f[len(self.root) + 1:] for f in found if f.startswith(self.root + "/"))
        return self._retry("list", "", find)

    def delete_object(self, key: str) -> None:
        """Delete one object (one request); missing is fine."""
        def rm_file():
            try:
                self.fs.rm_file(self.path(key), **self._kw())
            except FileNotFoundError:
                pass
        self._retry("delete", key, rm_file)

    def delete(self, key: str) -> None:
        """Delete an object or everything under a prefix; missing is fine."""
        def rm():
            if not self.is_local:
                return s3_delete(self.fs, self.path(key), self.timeout)
            try:
                self.fs.rm(self.path(key), recursive=True)
            except FileNotFoundError:
                pass
        self._retry("delete", key, rm)


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _secret(value) -> str | None:
    return value.get_secret_value() if value is not None else None


def s3_server(cfg: StorageConfig) -> str:
    """How messages name the S3 server that cfg (or the environment) points at, without credentials."""
    endpoint = cfg.endpoint_url or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    return f"the S3 server at {_plain_url(endpoint)}" if endpoint else "AWS S3 (no endpoint set)"


def local_root(url: str) -> str | None:
    """The directory a plain path or file:// URL names, as open_store reads it (~ expanded, relative to the working
    directory); None for object storage."""
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in ("", "file"):
        return None
    return os.path.abspath(os.path.expanduser(url[len("file://"):] if scheme else url))


def open_store(url: str, cfg: StorageConfig | None = None, *, retry: RetryPolicy | None = None,
               connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0) -> Store:
    """A Store for a plain path, file:// URL or s3://bucket/prefix. Nothing is contacted yet."""
    cfg = cfg or StorageConfig()
    retry = retry or RetryPolicy()
    shown = _plain_url(url)
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme in ("", "file"):
        root = local_root(url)
        fix = f"make {root} a writable directory or point storage.url elsewhere"
        return Store(LocalFileSystem(), root, f"file://{root}", Redactor([]), retry, Fixes(fix, fix, fix))
    if scheme not in ("s3", "s3a"):
        raise StorageError(f"storage.url {shown!r}: unsupported scheme {scheme!r}; use a path, file:///abs/path "
                           "or s3://bucket/prefix")
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise StorageError(f"storage.url {shown!r} carries credentials; put them in storage.access_key_id / "
                           "storage.secret_access_key or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY instead")
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise StorageError(f"storage.url {shown!r} names no bucket; use s3://bucket/prefix")
    key = _secret(cfg.access_key_id) or _env("AWS_ACCESS_KEY_ID")
    secret = _secret(cfg.secret_access_key) or _env("AWS_SECRET_ACCESS_KEY")
    token = _env("AWS_SESSION_TOKEN")
    endpoint = cfg.endpoint_url or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    region = cfg.region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
    redact = Redactor([key, secret, token])
    import s3fs  # noqa: PLC0415 - only S3 users need it loaded

    fs = s3fs.S3FileSystem(
        key=key, secret=secret, token=token, endpoint_url=endpoint, skip_instance_cache=True, session=_aio_session(),
        use_listings_cache=False, client_kwargs={"region_name": region},
        config_kwargs={"connect_timeout": connect_timeout_s, "read_timeout": read_timeout_s,
                       "retries": {"total_max_attempts": 1},
                       # sha256 of every object is checked at load; skip botocore's extra CRC pass
                       "request_checksum_calculation": "when_required",
                       "response_checksum_validation": "when_required"})
    fs.retries = 2  # s3fs's own quick retries; the deadline-bounded retries are ours
    server = s3_server(cfg)
    fixes = Fixes(
        auth=f"give credentials that {server} accepts for bucket {bucket!r}: storage.access_key_id and "
             "storage.secret_access_key, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        unreachable=f"start {server}, or set storage.endpoint_url (or AWS_ENDPOINT_URL_S3) to a reachable one")
    root = f"{bucket}/{prefix}" if prefix else bucket
    return Store(fs, root, f"s3://{root}", redact, retry, fixes, CallTimeout(connect_timeout_s + read_timeout_s),
                 cfg.write_checksums)


def _aio_session():
    """A new aiobotocore session per store (its own credential chain), reading botocore's data files through one
    loader per process. A session's own loader parses the endpoint rules and the S3 model again: ~0.08 CPU-s per
    store (measured), and a run and its actors open stores for every checkpoint, debug record and model stage."""
    from aiobotocore.session import AioSession  # noqa: PLC0415 - only S3 users need it loaded

    session = AioSession()
    session.register_component("data_loader", _botocore_data_loader())
    return session


@functools.cache
def _botocore_data_loader():
    """botocore's loader as a default session builds it (AWS_DATA_PATH honoured); it caches what it parsed."""
    from aiobotocore.session import AioSession  # noqa: PLC0415

    return AioSession().get_component("data_loader")


def check_storage(url: str, cfg: StorageConfig | None = None, *, deadline_s: float = 10.0) -> Store:
    """Fail early, with one clear message naming the URL and the fix, when `url` cannot be written and read
    back (unreachable endpoint, wrong credentials, missing bucket, unwritable directory). Returns the Store."""
    probe_store = open_store(url, cfg, retry=RetryPolicy(deadline_s=deadline_s, max_backoff_s=2.0),
                             connect_timeout_s=min(5.0, deadline_s), read_timeout_s=min(30.0, deadline_s))
    key = f".spillover-probe-{uuid.uuid4().hex[:12]}"
    data = b"spillover storage probe"
    try:
        probe_store.put_bytes(key, data)
        if probe_store.get_bytes(key) != data:
            raise StorageError(f"storage {probe_store.url} returned different bytes than written; "
                               "check the S3 endpoint (storage.endpoint_url)")
        probe_store.delete(key)
    except StorageError as err:
        if isinstance(err, ObjectMissing):
            what = "the directory cannot be made" if probe_store.is_local else "the bucket does not exist"
            raise StorageError(f"storage check of {probe_store.url} failed: {what} ({err}). Fix: "
                               f"{'create it' if not probe_store.is_local else 'use a writable path'} or correct "
                               "storage.url") from None
        raise type(err)(f"storage check of {probe_store.url} failed: {err}") from None
    log.info("storage %s is reachable and writable", probe_store.url)
    return open_store(url, cfg)
