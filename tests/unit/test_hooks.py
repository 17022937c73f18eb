"""infra/hooks.py: the test hook point loads the plugin SPILLOVER_TEST_HOOKS names; the kill -9 plugin
(tests/e2e/kill_hook.py) SIGKILLs a real process at exactly the SPILLOVER_KILL_AT point."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spillover.infra.hooks import HookError, hook_point

TESTS = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPILLOVER_")}
    clean["PYTHONPATH"] = os.pathsep.join([str(TESTS / "e2e"), str(TESTS.parent)])
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


def test_kill_hook_kills_at_its_point_only_and_only_when_loaded():
    code = "from spillover.infra.hooks import hook_point\nfor i in range(3):\n    hook_point('update', i)\n    print(i)"
    killed = _run(code, SPILLOVER_TEST_HOOKS="kill_hook", SPILLOVER_KILL_AT="update:1")
    assert killed.returncode == -signal.SIGKILL and killed.stdout.split() == ["0"]
    assert _run(code, SPILLOVER_TEST_HOOKS="kill_hook", SPILLOVER_KILL_AT="generate:1").stdout.split() == ["0", "1", "2"]
    assert _run(code, SPILLOVER_KILL_AT="update:1").returncode == 0  # no plugin loaded: nothing happens


def test_a_bad_plugin_name_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("SPILLOVER_TEST_HOOKS", raising=False)
    hook_point("update", 0)  # unset: a no-op
    monkeypatch.setenv("SPILLOVER_TEST_HOOKS", "no_such_hook_module")
    with pytest.raises(HookError, match="SPILLOVER_TEST_HOOKS='no_such_hook_module'"):
        hook_point("update", 0)
