"""Prefect's ephemeral API server, started so that it dies with this process (even a SIGKILLed one).

Prefect 3 starts a temporary server (`uvicorn ... prefect.server.api.server:create_app`) the first time a
process without PREFECT_API_URL needs the API, as a plain subprocess stopped by an atexit hook: a SIGKILLed
driver left it running with PPID 1. Prefect finds that server as `SubprocessASGIServer()`, the instance
registered under the key None (prefect.testing.utilities.prefect_test_harness registers its own server the
same way, Prefect issue #21544). `install()` registers `FateSharedServer` there before Prefect starts one:
the same command, run through infra/fate_share.py. Prefect still starts it lazily and stops it at exit.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from ..fate_share import fate_shared


class FateSharedServer(SubprocessASGIServer):
    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        """SubprocessASGIServer._run_uvicorn_command of Prefect 3.9, wrapped by fate_shared
        (tests/unit/test_process_lifetime.py checks that the command and environment stay Prefect's)."""
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        args = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on"]
        return subprocess.Popen(args=fate_shared(args), env={
            **os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)})


def install() -> None:
    """Make FateSharedServer the ephemeral server of this process, unless one is already registered."""
    if None not in SubprocessASGIServer._instances:
        FateSharedServer()  # SubprocessASGIServer.__new__ registers it under its port, None
