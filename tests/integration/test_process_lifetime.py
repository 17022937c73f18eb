"""Every process a run starts dies with it, even when the run is SIGKILLed (infra/fate_share.py): a plain
command, the real sglang-router (launched from a worker thread that exits first, as the rollout manager
does), and the command of Prefect's ephemeral server. The kill -9 e2e tests check the same for whole runs,
the ephemeral Prefect server included."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from run_processes import reap, session_processes, wait_until_gone
from waiting import wait_for

# Started in a thread that returns before the parent is killed: PR_SET_PDEATHSIG alone would fire at that
# thread's exit, so "still alive after the thread is gone" is checked too.
CHILD = textwrap.dedent("""
    import sys, threading, time
    {setup}
    started = []
    thread = threading.Thread(target=lambda: started.append(start()))
    thread.start(); thread.join()
    time.sleep(0.5)
    print("ready", flush=True)
    time.sleep(600)
""")


def start_in_own_session(setup: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(setup=setup)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    line = proc.stdout.readline()
    assert line == b"ready\n", line + proc.stdout.read(4000) if proc.poll() is not None else line
    return proc


def kill_9_and_check_nothing_left(proc: subprocess.Popen, expect_in_session: str, grace_s: float) -> None:
    try:
        alive = [cmd for pid, cmd in session_processes(proc.pid) if pid != proc.pid]
        assert any(expect_in_session in cmd for cmd in alive), alive  # started, and outlived its thread
        proc.kill()
        proc.wait(10)
        left = wait_until_gone([proc.pid], grace_s)
        assert left == [], f"still alive after the parent's SIGKILL: {left}"
    finally:
        proc.kill()
        reap([proc.pid])


def test_fate_shared_command_dies_with_a_sigkilled_parent():
    proc = start_in_own_session(textwrap.dedent("""
        import subprocess
        from spillover.infra.fate_share import fate_shared
        def start():
            return subprocess.Popen(fate_shared(["sleep", "600"]))
    """))
    kill_9_and_check_nothing_left(proc, "sleep 600", grace_s=10)


def test_without_pidfds_the_wrapper_polls_and_the_command_still_dies():
    proc = start_in_own_session(textwrap.dedent("""
        import os, subprocess
        import spillover.infra.fate_share as fate_share
        code = ("import os, runpy, sys; del os.pidfd_open; "  # as on a kernel before 5.3
                f"sys.argv = [sys.argv[0], '{os.getpid()}', '--', 'sleep', '600']; "
                f"runpy.run_path({fate_share.__file__!r}, run_name='__main__')")
        def start():
            return subprocess.Popen([sys.executable, "-c", code])
    """))
    kill_9_and_check_nothing_left(proc, "sleep 600", grace_s=10)


def test_whole_group_mode_takes_the_commands_own_children_too():
    """As SGLang's server would run (its own session, scheduler children): every process of the wrapper's
    session goes when the parent is SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, time
        from spillover.infra.fate_share import fate_shared
        wrapper = subprocess.Popen(fate_shared(["sh", "-c", "sleep 600 & exec sleep 601"], whole_group=True),
                                   start_new_session=True)
        print(wrapper.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, start_new_session=True)
    wrapper = int(proc.stdout.readline())

    def sleeps() -> list[str]:
        return [cmd for _, cmd in session_processes(wrapper) if cmd.startswith("sleep 60")]
    try:
        wait_for(sleeps, 5, "the command and its own child running", until=lambda found: len(found) == 2)
        proc.kill()
        proc.wait(10)
        assert wait_until_gone([wrapper], 15) == []
    finally:
        proc.kill()
        reap([proc.pid, wrapper])


def test_group_mode_refuses_to_run_outside_its_own_group():
    from spillover.infra.fate_share import fate_shared

    out = subprocess.run(fate_shared(["true"], whole_group=True), capture_output=True, text=True)
    assert out.returncode == 1 and "must lead its process group" in out.stderr


def test_router_dies_with_a_sigkilled_driver():
    proc = start_in_own_session(textwrap.dedent("""
        from spillover.rollout.fleet.router import Router
        def start():
            return Router.launch(host="127.0.0.1")
    """))
    kill_9_and_check_nothing_left(proc, "sglang::router", grace_s=15)  # its process title


def test_wrapper_passes_on_exit_status_and_sigterm():
    from spillover.infra.fate_share import fate_shared

    assert subprocess.run(fate_shared(["sh", "-c", "exit 7"])).returncode == 7
    proc = subprocess.Popen(fate_shared(["sleep", "600"]))
    try:
        assert proc.poll() is None
        proc.terminate()
        assert proc.wait(10) == -15  # the command died of the forwarded SIGTERM, and the wrapper likewise
    finally:
        proc.kill()


def test_ephemeral_server_command_is_prefects_wrapped(monkeypatch):
    """FateSharedServer copies Prefect's private _run_uvicorn_command: a Prefect upgrade that changes the
    command or its environment fails here."""
    import prefect.server.api.server as prefect_server

    from spillover.infra.fate_share import fate_shared
    from spillover.infra.prefect.server import FateSharedServer

    calls = []
    monkeypatch.setattr(prefect_server.subprocess, "Popen", lambda **kw: calls.append(kw))
    theirs = object.__new__(prefect_server.SubprocessASGIServer)
    ours = object.__new__(FateSharedServer)
    theirs.port = ours.port = 8123  # instances made without registering them in Prefect's table
    prefect_server.SubprocessASGIServer._run_uvicorn_command(theirs)
    ours._run_uvicorn_command()
    assert calls[1]["args"] == fate_shared(calls[0]["args"]) != calls[0]["args"]
    assert calls[1]["env"] == calls[0]["env"]
    assert set(calls[0]) == {"args", "env"}, "Prefect now passes more to Popen: copy it into FateSharedServer"


@pytest.mark.parametrize("api_url, installed", [(None, True), ("http://127.0.0.1:9/api", False)])
def test_process_defaults_install_the_server_only_without_an_api_url(api_url, installed, monkeypatch):
    from prefect.server.api.server import SubprocessASGIServer

    from spillover.infra.prefect.env import apply_process_defaults
    from spillover.infra.prefect.server import FateSharedServer

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # Prefect's table of servers, this test's own
    if api_url:
        monkeypatch.setenv("PREFECT_API_URL", api_url)
    else:
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    apply_process_defaults()
    assert isinstance(SubprocessASGIServer._instances.get(None), FateSharedServer) == installed
    assert isinstance(SubprocessASGIServer(), FateSharedServer) == installed  # what Prefect's client gets
