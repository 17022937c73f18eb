"""Every control post (pause/continue generation, begin/end weight update, flush_cache) has a time limit,
rollout/sglang/backend.py's CONTROL_TIMEOUT_S: an engine that takes the connection and never answers fails the post
with a transport timeout naming the engine and the limit, on every client that sends one (EngineClient: the manager's
pause/continue/flush and the distributed sync's session; WeightPoster: the tensor path's session), instead of holding
the flow for as long as the engine hangs."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from spillover.rollout.fleet.engine_client import EngineClient, EngineTimeout
from spillover.rollout.fleet.weights.weight_poster import WeightPoster
from spillover.rollout.fleet.weights.fleet_weights import DistributedWeights
from spillover.rollout.sglang import backend as sgl

LIMIT_S = 0.5
PATIENCE_S = 10 * LIMIT_S  # how long a test waits before calling the post unbounded


@pytest.fixture
def silent_engine():
    """A loopback server that accepts connections, reads what is sent and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(sgl, "CONTROL_TIMEOUT_S", LIMIT_S)


def raised_within(call, patience_s: float = PATIENCE_S) -> BaseException:
    """What call() raised, run in a daemon thread; fails the test when it still runs after patience_s (a post without
    a limit waits as long as the engine hangs) or returned."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - the test reads it
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(patience_s)
    assert not thread.is_alive(), f"still waiting for an answer after {patience_s} s"
    assert outcome, "the post returned"
    return outcome[0]


@pytest.mark.parametrize("route", sgl.CONTROL_ROUTES)
def test_engine_client_control_posts_time_out(silent_engine, short_limit, route):
    """The manager's pause/continue/flush posts (RolloutManager._each_engine) go through EngineClient.post."""
    async def post():
        async with EngineClient(silent_engine) as client:
            await client.post(sgl.ENDPOINTS[route], json={})

    tic = time.monotonic()
    raised = raised_within(lambda: asyncio.run(post()))
    assert isinstance(raised, EngineTimeout) and time.monotonic() - tic < PATIENCE_S / 2
    assert f"{sgl.ENDPOINTS[route]}: no answer within {LIMIT_S} s" in str(raised)


@pytest.mark.parametrize("route", sgl.MEMORY_ROUTES)
def test_memory_release_and_resume_posts_time_out(silent_engine, monkeypatch, route):
    """Colocation's release/resume (RolloutManager._post_memory) go through EngineClient.post with MEMORY_TIMEOUT_S."""
    monkeypatch.setattr(sgl, "MEMORY_TIMEOUT_S", LIMIT_S)

    async def post():
        async with EngineClient(silent_engine) as client:
            await client.post(sgl.ENDPOINTS[route], json={})

    raised = raised_within(lambda: asyncio.run(post()))
    assert isinstance(raised, EngineTimeout) and f"{sgl.ENDPOINTS[route]}: no answer within {LIMIT_S} s" in str(raised)


def test_other_posts_keep_the_callers_limit(silent_engine, short_limit):
    """A weight bucket may take minutes: only the control routes get CONTROL_TIMEOUT_S."""
    async def post():
        async with EngineClient(silent_engine) as client:
            await client.post(sgl.ENDPOINTS["update_from_distributed"], json={}, timeout=2 * LIMIT_S)

    raised = raised_within(lambda: asyncio.run(post()))
    assert isinstance(raised, EngineTimeout) and f"no answer within {2 * LIMIT_S} s" in str(raised)


class Remote:
    """An actor method's .remote(): something to await (or to leave, as the sync leaves the learner's leave)."""

    def __init__(self, value):
        self.value = value

    def remote(self, *args) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.set_result(self.value)
        return done


class IdlePolicy:
    """The learner side of a distributed sync, enough to reach the session's first post (tests/contract drives a whole
    sync)."""

    weight_specs = Remote([("norm.weight", "float32", [4])])
    weight_sync_address = Remote(("127.0.0.1", 1))
    join_weight_group = Remote(None)
    leave_weight_group = Remote(None)
    broadcast_weights = Remote({"sent_bytes": 0})


class MemberOfGroup(EngineClient):
    """The silent engine, except that joining and leaving the group answer (the session's begin is what hangs)."""

    async def post(self, path, json=None, timeout=None):
        if path in (sgl.ENDPOINTS["init_update_group"], sgl.ENDPOINTS["destroy_update_group"]):
            return None
        return await super().post(path, json, timeout)

    async def health(self, generate: bool = False, timeout_s: float = 5.0) -> bool:
        return True


def test_a_distributed_sync_fails_within_the_limit_when_begin_is_never_answered(silent_engine, short_limit):
    """Its session's begin and end (DistributedWeights.sync) go through EngineClient.post too."""
    clients: dict[str, MemberOfGroup] = {}  # one per engine, as the manager keeps them
    sync = DistributedWeights(lambda url: clients.setdefault(url, MemberOfGroup(url)), bucket_bytes=64)

    async def run():
        try:
            await sync.sync(IdlePolicy(), [silent_engine], version=3)
        finally:
            await asyncio.gather(*(client.aclose() for client in clients.values()))

    tic = time.monotonic()
    raised = raised_within(lambda: asyncio.run(run()))
    assert isinstance(raised, EngineTimeout) and "/begin_weight_update" in str(raised)
    assert time.monotonic() - tic < PATIENCE_S / 2


def test_the_tensor_paths_session_fails_within_the_limit(silent_engine, short_limit):
    """WeightPoster (engine actors, colocated ranks, bench/gpu_smoke.py), a sync httpx client."""
    def session() -> None:
        with WeightPoster(silent_engine, "torch").session():
            pass

    tic = time.monotonic()
    raised = raised_within(session)
    assert isinstance(raised, httpx.TimeoutException) and time.monotonic() - tic < PATIENCE_S / 2
