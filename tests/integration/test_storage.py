"""infra/storage/store.py against file:// and a real S3 server (SeaweedFS): round trips, clear errors for wrong
credentials and unreachable endpoints (never echoing a secret), credentials from the environment, and
retries with backoff under a deadline."""
from __future__ import annotations

import errno
import hashlib
import logging
import socket
from urllib.parse import urlsplit

import pytest
from pydantic import SecretStr

from spillover.infra.config.run_config import StorageConfig, build_config
from spillover.bench.seaweed_server import free_ports
from spillover.infra.storage.checkpoint_list import checkpoint_url
from spillover.infra.storage.store import (ObjectMissing, StorageAuthError, StorageError, StorageUnreachable, check_storage,
                           open_store)
from spillover.infra.storage.errors import Fixes, Redactor, RetryPolicy, is_transient, with_retries


def test_round_trip_list_delete(storage_target):
    store = check_storage(storage_target.url, storage_target.cfg)
    payload = [b"header", bytearray(b"x" * 100_000), memoryview(b"tail")]
    info = store.put_buffers("a/b.bin", payload)
    whole = b"header" + b"x" * 100_000 + b"tail"
    assert (info.size, info.sha256) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert store.get_bytes("a/b.bin") == whole
    buf, got = store.get_buffer("a/b.bin")
    assert bytes(buf) == whole and got == info
    assert buf.readonly == (storage_target.kind == "s3")  # S3: a view of one bytes object (no copy to decode)
    store.put_bytes("c.json", b"{}")
    assert store.list() == ["a", "c.json"] and store.list("a") == ["b.bin"] and store.list("nope") == []
    assert store.exists("a/b.bin") and not store.exists("a/zz")
    store.delete("a")
    assert store.list() == ["c.json"] and not store.exists("a/b.bin")
    store.delete("a")  # deleting what is gone is fine
    with pytest.raises(ObjectMissing, match="a/b.bin"):
        store.get_bytes("a/b.bin")


def test_plain_paths_and_file_urls_are_the_same_store(tmp_path):
    assert open_store(str(tmp_path / "s")).url == open_store(f"file://{tmp_path}/s").url == f"file://{tmp_path}/s"
    assert checkpoint_url(build_config({"run_dir": str(tmp_path)})) == f"{tmp_path.resolve()}/checkpoints"
    assert checkpoint_url(build_config({"run_dir": str(tmp_path), "storage": {"url": "s3://b/run"}})) == "s3://b/run"


def test_wrong_credentials_clear_error_no_secret_anywhere(s3_server, caplog):
    caplog.set_level(logging.DEBUG)  # botocore/s3fs debug logs included
    wrong_secret = "WrongSecret-" + "q7Zp3xVb9"
    cfg = s3_server.storage_config(secret_access_key=SecretStr(wrong_secret))
    url = s3_server.url("auth-test")
    with pytest.raises(StorageAuthError) as err:
        check_storage(url, cfg, deadline_s=5)
    msg = str(err.value)
    assert url in msg and "storage.secret_access_key" in msg and "AWS_SECRET_ACCESS_KEY" in msg
    assert wrong_secret not in msg and s3_server.secret_key not in msg
    assert wrong_secret not in repr(open_store(url, cfg)) and wrong_secret not in repr(cfg)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    # the right credentials in a full round trip never reach the logs either
    store = check_storage(url, s3_server.storage_config())
    store.put_bytes("x", b"1")
    store.get_bytes("x")
    assert caplog.records, "debug logging was captured"
    assert wrong_secret not in caplog.text and s3_server.secret_key not in caplog.text
    assert s3_server.secret_key not in repr(s3_server) and s3_server.secret_key not in repr(store)


def test_unreachable_endpoint_fails_fast_with_the_fix(monkeypatch):
    """check_storage retries a refused connection until its deadline, on a clock that only its sleeps advance
    (FakeClock): the same attempts and backoffs, none of the waiting."""
    import spillover.infra.storage.store

    clock, real_policy = FakeClock(), spillover.infra.storage.store.RetryPolicy
    monkeypatch.setattr(spillover.infra.storage.store, "RetryPolicy",
                        lambda **kw: real_policy(**kw, sleep=clock.sleep, clock=lambda: clock.now))
    (port,) = free_ports(1)
    cfg = StorageConfig(endpoint_url=f"http://127.0.0.1:{port}", access_key_id=SecretStr("AKID0001"),
                        secret_access_key=SecretStr("SuperSecretValue99"))
    with pytest.raises(StorageUnreachable) as err:
        check_storage("s3://bucket/run1", cfg, deadline_s=2)
    assert sum(clock.sleeps) == pytest.approx(2) and len(clock.sleeps) >= 3  # backed off until the deadline
    msg = str(err.value)
    assert f"({len(clock.sleeps) + 1} attempts)" in msg
    assert "ConnectionRefusedError" in msg  # the attempts were refused at once, not ended by a connect timeout
    assert "s3://bucket/run1" in msg and f"127.0.0.1:{port}" in msg and "storage.endpoint_url" in msg
    assert "SuperSecretValue99" not in msg


def test_credentials_and_endpoint_from_standard_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    store = check_storage(s3_server.url("env-test"), StorageConfig())
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "EnvWrongSecret123")
    with pytest.raises(StorageAuthError) as err:
        check_storage(s3_server.url("env-test"), StorageConfig(), deadline_s=5)
    assert "EnvWrongSecret123" not in str(err.value)


def test_stores_have_their_own_sessions_and_share_botocores_parsed_data(s3_server):
    first, second = (open_store(s3_server.url("shared"), s3_server.storage_config()) for _ in range(2))
    assert first.fs.session is not second.fs.session  # each its own credential chain
    assert first.fs.session.get_component("data_loader") is second.fs.session.get_component("data_loader")
    first.put_bytes("k", b"v")
    assert second.get_bytes("k") == b"v"


def test_bad_urls_are_refused_clearly(tmp_path):
    with pytest.raises(StorageError) as err:
        open_store("s3://AKID:TopSecret42@bucket/x")
    assert "TopSecret42" not in str(err.value) and "storage.access_key_id" in str(err.value)
    with pytest.raises(StorageError, match="unsupported scheme 'gs'"):
        open_store("gs://bucket/x")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(StorageError, match="a_file") as err:
        check_storage(str(tmp_path / "a_file" / "store"))
    assert "storage.url" in str(err.value)


def test_transient_classification():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "PutObject")
    assert is_transient(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert is_transient(TimeoutError("read timed out"))
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(OSError(errno.EREMOTEIO, "InternalError"))
    assert is_transient(client_error("ServiceUnavailable", 503)) and is_transient(client_error("Weird", 502))
    assert is_transient(client_error("BadDigest", 400)) and is_transient(client_error("IncompleteBody", 400))
    wrapped = OSError(errno.EIO, "wrapped")
    wrapped.__cause__ = ConnectionResetError()
    assert is_transient(wrapped)
    assert not is_transient(PermissionError("SignatureDoesNotMatch"))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(FileNotFoundError("nope")) and not is_transient(ValueError("bad"))


class FakeClock:
    """An injected clock that only the injected sleep moves: retry tests take no real time."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def policy(self, **kw) -> RetryPolicy:
        return RetryPolicy(**kw, sleep=self.sleep, clock=lambda: self.now)


def test_retries_back_off_until_success_or_deadline(caplog):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused by key=SecretXYZ1")
        return "ok"
    redact, fixes = Redactor(["SecretXYZ1"]), Fixes("auth fix", "start the server")
    clock = FakeClock()
    policy = clock.policy(deadline_s=10, first_backoff_s=0.05, max_backoff_s=1)
    assert with_retries(flaky, what="write", url="s3://b/k", policy=policy, redact=redact, fixes=fixes) == "ok"
    assert len(calls) == 4 and len(clock.sleeps) == 3
    for slept, base in zip(clock.sleeps, (0.05, 0.1, 0.2)):  # exponential, +-25% jitter
        assert base * 0.75 <= slept <= base * 1.25
    assert "SecretXYZ1" not in caplog.text and "retrying" in caplog.text

    clock = FakeClock()
    with pytest.raises(StorageUnreachable) as err:
        with_retries(lambda: (_ for _ in ()).throw(TimeoutError("SecretXYZ1 timed out")),
                     what="read", url="s3://b/k", policy=clock.policy(deadline_s=0.5, first_backoff_s=0.05),
                     redact=redact, fixes=fixes)
    assert sum(clock.sleeps) == pytest.approx(0.5)  # the last wait is cut to the deadline
    assert len(clock.sleeps) >= 3 and f"({len(clock.sleeps) + 1} attempts)" in str(err.value)
    assert "s3://b/k" in str(err.value) and "start the server" in str(err.value)
    assert "SecretXYZ1" not in str(err.value) and err.value.__cause__ is None


def test_only_transient_errors_are_retried():
    clock, calls = FakeClock(), []
    fixes = Fixes("give the right keys", "start the server", other="make it writable")

    def failing(exc):
        def fn():
            calls.append(exc)
            raise exc
        return fn
    for exc, kind, fix in ((PermissionError("AccessDenied"), StorageAuthError, "give the right keys"),
                           (FileNotFoundError("no such key"), ObjectMissing, "does not exist"),
                           (ValueError("bad argument"), StorageError, "make it writable")):
        with pytest.raises(kind, match=fix):
            with_retries(failing(exc), what="read", url="s3://b/k", policy=clock.policy(), redact=Redactor([]),
                         fixes=fixes)
    assert len(calls) == 3 and clock.sleeps == []  # one attempt each, no wait


def test_a_hung_server_cannot_block_a_call_forever(outage_s3_server):
    """SIGSTOPped server: the request body fills the socket buffers and botocore's read timeout never
    starts; the per-call time limit must end the attempt so the deadline can fail it."""
    store = open_store(outage_s3_server.url("hung"), outage_s3_server.storage_config(), connect_timeout_s=0.5,
                       read_timeout_s=0.5,
                       retry=RetryPolicy(deadline_s=1, first_backoff_s=0.1))  # one attempt: its limit is ~2 s
    outage_s3_server.pause()
    try:
        with pytest.raises(StorageUnreachable, match="hung/big") as err:
            store.put_bytes("big", b"x" * (8 << 20))
    finally:
        outage_s3_server.resume()
    assert "(1 attempts): FSTimeoutError" in str(err.value)  # the per-call limit ended the one attempt
    # and it works again once the server runs, under the default limits: a just-resumed server on a busy machine can
    # miss the 0.5 s connect limit above (it did once, with background work running)
    open_store(outage_s3_server.url("hung"), outage_s3_server.storage_config()).put_bytes("big", b"ok")


def test_an_upload_that_lost_its_body_cannot_replace_the_object(outage_s3_server):
    """A timed-out attempt can reach the server after its retry succeeded. Here our own signed PutObject request
    reaches a paused server as headers only (the client gave up before `100 Continue`): on resume SeaweedFS
    stored such a request as an empty object until uploads carried their sha256; now it refuses it."""
    store = open_store(outage_s3_server.url("lost-body"), outage_s3_server.storage_config())
    store.put_bytes("meta.json", b"old")  # connects the client, so the hook below can be registered
    sent = []
    store.fs.s3.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
    store.put_bytes("meta.json", b'{"v": 2}')
    url = urlsplit(sent[-1].url)
    head = f"PUT {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\n" + "".join(
        f"{k}: {v.decode() if isinstance(v, bytes) else v}\r\n" for k, v in sent[-1].headers.items()) + "\r\n"
    assert "x-amz-checksum-sha256" in head.lower()
    outage_s3_server.pause()
    try:
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall(head.encode())
            conn.shutdown(socket.SHUT_WR)  # gone before the body
            outage_s3_server.resume()
            reply = b"".join(iter(lambda: conn.recv(1 << 16), b""))  # the server answers, then closes
    finally:
        outage_s3_server.resume()
    assert b"HTTP/1.1 200" not in reply, reply[-300:]
    assert store.get_bytes("meta.json") == b'{"v": 2}'


def test_large_local_objects_are_mapped_copy_on_write_and_verified(tmp_path):
    """From MMAP_MIN_BYTES on a local object is mapped, not copied: the view is still hashed, writable, and a
    write to it never reaches the file; a shorter or changed object shows in the returned size/sha256."""
    from spillover.infra.storage.hashed_io import MMAP_MIN_BYTES

    store = open_store(str(tmp_path / "s"))
    data = bytes(range(256)) * ((MMAP_MIN_BYTES * 3) // 256)
    info = store.put_buffers("big", [data[:100], memoryview(data)[100:]])
    assert (info.size, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    buf, got = store.get_buffer("big", size=len(data))
    assert got == info and not buf.readonly and bytes(buf) == data
    buf[0] ^= 0xFF
    assert store.get_bytes("big") == data and store.get_buffer("big")[1] == info
    store.put_bytes("big", data[:MMAP_MIN_BYTES + 5])  # truncated (a new file, as every write makes)
    assert store.get_buffer("big", size=len(data))[1].size == MMAP_MIN_BYTES + 5
    flipped = bytearray(data)
    flipped[-1] ^= 1
    store.put_bytes("big", bytes(flipped))
    got = store.get_buffer("big", size=len(data))[1]
    assert (got.size, got.sha256) == (len(data), hashlib.sha256(flipped).hexdigest())
