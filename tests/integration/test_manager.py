"""RolloutManager with real parts: Ray actors holding torch engines, the real sglang-router, real HTTP.

The shared `rollout_manager` (two engines) is put back after each test that changes it; the shutdown test
starts its own one-engine manager, with the health monitor on from its config.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import psutil
import pytest

from fleet_probes import health_check, health_monitor_running, resume_memory, take_weight_update_events
from spillover.rollout.fleet.engine_client import EngineClient
from spillover.rollout.fleet.weights.weight_update import WeightUpdate
from spillover.rollout.sglang.protocol import (ContinueGenerationRequest, GenerateJob, GenerateRequest,
                                               GenerateResponse, PauseGenerationRequest)
from waiting import wait_for

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 3], [40, 2, 2, 11, 30, 31, 12], [17], [33, 34, 35, 36], [9, 8, 7],
           [12, 13], [44, 45, 46]]
GREEDY = {"max_new_tokens": 12, "temperature": 0}
LONG = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}


def job(prompt: list[int], params: dict, **fields) -> GenerateJob:
    return GenerateJob(GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True, **fields))


def batch(params: dict, prompts=PROMPTS) -> list[GenerateJob]:
    return [job(p, params) for p in prompts]


IN_ONE_SESSION = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]


def engine_events(manager) -> list[list[str]]:
    """Each engine's weight-update session and route outcomes since the last call, in order."""
    import ray

    return ray.get([h.actors[0].__ray_call__.remote(take_weight_update_events) for h in manager.engines])


def loads(url: str) -> tuple[int, int]:
    entry = httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]
    return entry["num_running_reqs"], entry["num_waiting_reqs"]


def used_tokens(url: str) -> int:
    """Prompt and output tokens of the engine's running requests."""
    return httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False



def in_background(fn, *args):
    """Run fn(*args) in a thread; returns (thread, box) where box holds 'result' or 'error'."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as err:  # surfaced by the test
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_generate_through_router_in_order_with_callbacks(rollout_manager):
    m = rollout_manager
    assert sorted(m.router.workers()) == sorted(m.urls) and len(m.urls) == 2
    assert all(url.startswith("http://127.0.0.1:") for url in [*m.urls, m.router.url])
    seen: list[int] = []
    items = [job(PROMPTS[0], GREEDY, rid="ab" * 16), *batch(GREEDY, PROMPTS[1:])]
    results = m.generate(items, on_result=lambda i, r: seen.append(i))
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert results[0].meta_info.id == "ab" * 16
    for prompt, res in zip(PROMPTS, results):
        meta = res.meta_info
        assert meta.prompt_tokens == len(prompt)
        assert meta.completion_tokens == len(res.output_ids) == len(meta.output_token_logprobs)
        assert meta.finish_reason.type in ("stop", "length")
    # Greedy through the router equals greedy straight from each engine: same weights everywhere.
    for url in m.urls:
        direct = httpx.post(url + "/generate", json={"input_ids": PROMPTS[2], "sampling_params": GREEDY}).json()
        assert direct["output_ids"] == results[2].output_ids


def test_generate_from_inside_another_event_loop(rollout_manager):
    """The API is sync; code on an event loop of its own (a custom rollout function) runs it in a thread."""
    import asyncio

    async def custom_rollout() -> list[GenerateResponse]:
        return await asyncio.to_thread(rollout_manager.generate, batch(GREEDY, PROMPTS[:3]))

    results = asyncio.run(custom_rollout())
    assert [r.meta_info.prompt_tokens for r in results] == [len(p) for p in PROMPTS[:3]]


def test_weight_update_changes_outputs_and_versions(rollout_manager, tiny_model_dir, varied_model_dir):
    from safetensors.torch import load_file

    m = rollout_manager
    before = m.generate(batch(GREEDY))
    tiny = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    engine_events(m)
    try:
        # a state dict: put in Ray's object store once, posted to each engine
        versions = m.update_weights(WeightUpdate("tensor", tiny, 7))
        assert versions == {0: 7, 1: 7}
        assert engine_events(m) == [IN_ONE_SESSION] * 2  # /update_weights_from_tensor inside SGLang's session
        for url in m.urls:
            assert httpx.get(url + "/model_info").json()["weight_version"] == "7"  # text, as SGLang
        after = m.generate(batch(GREEDY))
        assert [r.output_ids for r in after] != [r.output_ids for r in before]
        assert {r.meta_info.weight_version for r in after} == {7}
    finally:
        # from disk, like SGLang's endpoint
        assert m.update_weights(WeightUpdate("disk", varied_model_dir, 0)) == {0: 0, 1: 0}
    restored = m.generate(batch(GREEDY))
    assert [r.output_ids for r in restored] == [r.output_ids for r in before]


def test_tensor_update_in_buckets_runs_in_one_session_and_a_failed_one_ends_it(rollout_manager, tiny_model_dir,
                                                                                varied_model_dir):
    """The client path that drives SGLang (EngineActor.update_weights: begin, a bucket per call, end) against the
    torch engine's /update_weights_from_tensor; an update the engine refuses still ends the session, so the next
    update can begin, and leaves the weights and version as they were."""
    import ray
    import torch
    from safetensors.torch import load_file

    from spillover.bench.weight_digests import engine_weight_digests, tensor_digest

    m = rollout_manager
    tiny = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    before = [a.output_ids for a in m.generate(batch(GREEDY))]
    engine_events(m)
    try:
        actor = m.engines[0].actors[0]
        assert ray.get(actor.update_weights.remote(tiny, 5, 20000)) == 5
        events = engine_events(m)[0]
        assert events[0] == "begin_weight_update" and events[-1] == "end_weight_update", events
        assert events[1:-1] == ["update_weights_from_tensor"] * len(events[1:-1]) and len(events) > 4, events
        loaded = ray.get(actor.__ray_call__.remote(engine_weight_digests))
        assert loaded == {name: tensor_digest(tiny[name]) for name in loaded}

        with pytest.raises(Exception, match="update_weights_from_tensor"):
            m.update_weights(WeightUpdate("tensor", {**tiny, "model.no_such.weight": torch.zeros(3)}, 9))
        assert engine_events(m) == [["begin_weight_update", "update_weights_from_tensor failed",
                                     "end_weight_update"]] * 2
        assert [httpx.get(u + "/model_info").json()["weight_version"] for u in m.urls] == ["5", "0"]
        assert m.update_weights(WeightUpdate("tensor", tiny, 6)) == {0: 6, 1: 6}  # a session can begin again
        assert engine_events(m) == [IN_ONE_SESSION] * 2
    finally:
        assert m.update_weights(WeightUpdate("disk", varied_model_dir, 0)) == {0: 0, 1: 0}
    assert [a.output_ids for a in m.generate(batch(GREEDY))] == before


def test_abort_all_mid_generation_returns_partial_tokens_and_idles(rollout_manager):
    m = rollout_manager
    requests = batch(LONG, PROMPTS * 2)
    thread, box = in_background(m.generate, requests)
    wait_for(lambda: [loads(u)[0] for u in m.urls], 20, "every engine running the batch", every=0.02,
             until=lambda running: all(n > 0 for n in running))
    # the engines hold more tokens than all the prompts: some request has decoded tokens to return
    prompt_tokens = sum(len(r.request.input_ids) for r in requests)
    wait_for(lambda: sum(used_tokens(u) for u in m.urls), 20, f"more than {prompt_tokens} tokens held", every=0.02,
             until=lambda used: used > prompt_tokens)
    m.abort_all()
    thread.join(30)
    assert "error" not in box, box.get("error")
    results = box["result"]
    assert {r.meta_info.finish_reason.type for r in results} == {"abort"}
    partial = [len(r.output_ids) for r in results]
    assert any(0 < n < LONG["max_new_tokens"] for n in partial), partial
    for r in results:
        assert r.meta_info.completion_tokens == len(r.output_ids) == len(r.meta_info.output_token_logprobs)
    assert all(loads(u) == (0, 0) for u in m.urls)
    assert len(m.generate(batch(GREEDY, PROMPTS[:2]))) == 2  # the next round runs normally


def test_on_result_returning_true_stops_the_round_and_generate_returns_idle(rollout_manager):
    """The async partial-rollout driver's pattern: once enough answers are in, the callback says stop."""
    m = rollout_manager
    short = batch({"max_new_tokens": 2, "temperature": 0}, PROMPTS[:4])
    done: list[int] = []

    def on_result(index: int, _response: GenerateResponse) -> bool:
        done.append(index)
        return len(done) >= 4

    results = m.generate(short + batch(LONG), on_result=on_result)
    kinds = [r.meta_info.finish_reason.type for r in results]
    assert "abort" not in kinds[:4] and set(kinds[4:]) == {"abort"}, kinds
    assert sorted(done) == list(range(len(results)))  # every answer reached the callback once
    assert all(loads(u) == (0, 0) for u in m.urls)  # idle when generate returned, not some time later
    after = m.generate(batch({**LONG, "max_new_tokens": 5}, PROMPTS[:2]))  # no abort left over to cut it
    assert [len(r.output_ids) for r in after] == [5, 5]


def test_calling_the_manager_from_a_callback_fails_clearly(rollout_manager):
    m = rollout_manager

    def on_result(index: int, _response: GenerateResponse) -> None:
        m.abort_all()

    with pytest.raises(RuntimeError, match="return True from on_result"):
        m.generate(batch(GREEDY, PROMPTS[:2]), on_result=on_result)
    assert len(m.generate(batch(GREEDY, PROMPTS[:2]))) == 2


def test_kill_9_engine_mid_batch_every_request_completes_and_engine_returns(rollout_manager):
    m = rollout_manager
    victim = m.engines[0]
    thread, box = in_background(m.generate, batch({"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}))
    wait_for(lambda: loads(victim.url)[0], 20, "the victim engine running a request", every=0.02)
    os.kill(victim.pids[0], signal.SIGKILL)
    thread.join(60)
    assert "error" not in box, box.get("error")
    assert all(len(r.output_ids) == 300 for r in box["result"])
    status = health_check(m)  # the router retried on the live engine; the manager now replaces the dead one
    assert status[0] == "restarted" and status[1] == "ok"
    new_url = m.engines[0].url
    assert new_url != victim.url and m.engines[0].pids[0] != victim.pids[0]
    assert sorted(m.router.workers()) == sorted(m.urls)
    assert m.weight_versions == {0: 0, 1: 0}
    direct = httpx.post(new_url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    assert direct.status_code == 200


def test_a_restart_that_fails_after_the_start_is_done_again_by_the_next_update(rollout_manager, varied_model_dir,
                                                                                monkeypatch):
    """The new engine came up but its weights could not be loaded: it is stopped (no URL, not behind the router,
    never serving the folder's weights), and the next weight update starts it again before loading."""
    m = rollout_manager
    victim = m.engines[0]
    os.kill(victim.pids[0], signal.SIGKILL)
    reload = m.weights.reload

    async def fails(handle):
        raise RuntimeError("the weights could not be loaded")

    monkeypatch.setattr(m.weights, "reload", fails)
    with pytest.raises(RuntimeError, match="could not be loaded"):
        health_check(m)
    assert m.engines[0].url is None and sorted(m.router.workers()) == [m.engines[1].url]
    monkeypatch.setattr(m.weights, "reload", reload)
    assert m.update_weights(WeightUpdate("disk", varied_model_dir, 0)) == {0: 0, 1: 0}
    assert m.engines[0].url and sorted(m.router.workers()) == sorted(m.urls) and len(m.urls) == 2
    assert all(len(r.output_ids) == 5 for r in m.generate(batch({"max_new_tokens": 5, "ignore_eos": True})))


def test_hung_engine_is_found_by_the_monitor_restarted_and_its_requests_finish(rollout_manager, monkeypatch):
    m = rollout_manager
    victim, restarts = m.engines[1], m.restarts
    # a tiny CPU model answers /health_generate in milliseconds even mid-batch: a hung engine is found at once
    monkeypatch.setattr(m.cfg, "health_timeout_s", 1.0)
    thread, box = in_background(m.generate, batch({"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}))
    wait_for(lambda: loads(victim.url)[0], 20, "the victim engine running a request", every=0.02)
    os.kill(victim.pids[0], signal.SIGSTOP)  # alive but silent: /health_generate cannot answer
    m.start_health_monitor(0.1)
    try:
        wait_for(lambda: m.restarts, 60, "the monitor restarting the hung engine", until=lambda now: now > restarts)
    finally:
        m.stop_health_monitor()
        try:
            os.kill(victim.pids[0], signal.SIGCONT)
        except ProcessLookupError:
            pass
    thread.join(60)
    assert "error" not in box, box.get("error")
    assert all(len(r.output_ids) == 300 for r in box["result"])
    assert m.engines[1].url != victim.url
    assert sorted(m.router.workers()) == sorted(m.urls) and victim.url not in m.urls


def test_bad_request_raises_clearly_and_manager_keeps_working(rollout_manager):
    m = rollout_manager
    with pytest.raises(ValueError, match="max_new_tokens"):  # the request type refuses it before anything is sent
        job([3, 4], {"max_new_tokens": -1})
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the engine refuses it (HTTP 400)
        m.generate([job([3, 10**6], GREEDY)])
    assert len(m.generate(batch(GREEDY, PROMPTS[:2]))) == 2


def test_released_engines_are_not_probed_and_serve_again_once_resumed_and_loaded(rollout_manager, varied_model_dir,
                                                                                  monkeypatch):
    """Released engines cannot generate: /health_generate fails (SGLang's would run on freed memory and kill the
    server), so neither a health check nor the background monitor probes them, and nothing is restarted in the middle
    of a colocated update. /health says only that the server is up (the fleet starts engines with
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), so the router's own probes keep them registered. Resumed, as a
    colocated update resumes them, they load weights again and answer as before."""
    m = rollout_manager
    before = [a.output_ids for a in m.generate(batch(GREEDY, PROMPTS[:2]))]
    restarts, checks = m.restarts, []
    real_check = m._health_check

    async def counted_check():
        checks.append(await real_check())
        return checks[-1]

    monkeypatch.setattr(m, "_health_check", counted_check)
    m.offload()  # weights and KV cache: the torch engine frees them for real (tests/integration/test_colocate.py)
    try:
        assert all(httpx.get(url + "/health_generate", timeout=30).status_code == 503 for url in m.urls)
        assert all(httpx.get(url + "/health", timeout=30).status_code == 200 for url in m.urls)
        assert health_check(m) == {0: "released", 1: "released"}
        m.start_health_monitor(0.02)
        wait_for(lambda: len(checks), 30, "4 monitor checks", every=0.02, until=lambda n: n >= 4)
    finally:
        m.stop_health_monitor()
        resume_memory(m)
        loaded = m.update_weights(WeightUpdate("disk", varied_model_dir, 0))  # resumed weights are empty
    assert all(c == {0: "released", 1: "released"} for c in checks) and m.restarts == restarts
    assert loaded == {0: 0, 1: 0} and health_check(m) == {0: "ok", 1: "ok"}
    assert [a.output_ids for a in m.generate(batch(GREEDY, PROMPTS[:2]))] == before


def test_paused_engines_answer_the_liveness_probe_that_forming_a_weight_group_and_the_router_make(rollout_manager):
    """An update pauses the engines (rollout.overlap) and, with engines.weight_sync=distributed, forms its weight group
    after probing each engine's /health; the router probes /health too. SGLang's default /health is a 1-token
    generation, which a paused engine parks (the torch engine does the same: /health_generate gets no answer), so the
    fleet starts every engine with that probe off: its /health answers at once, paused or not."""
    m = rollout_manager
    retract = PauseGenerationRequest(mode="retract").model_dump()
    assert m._call(m._each_engine, "pause_generation", retract) is None
    try:
        for url in m.urls:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            with pytest.raises(httpx.TimeoutException):  # the generation probe waits for a step that never comes
                httpx.get(url + "/health_generate", timeout=1.5)
        async def form_probe():  # what forming a weight group asks (rollout/fleet/weights/fleet_weights.py)
            return await asyncio.gather(*(m._client(u).health() for u in m.urls))

        assert m._call(form_probe) == [True] * len(m.urls)
    finally:
        assert m._call(m._each_engine, "continue_generation", ContinueGenerationRequest().model_dump()) is None
    assert health_check(m) == {0: "ok", 1: "ok"}


def test_shutdown_leaves_no_process_and_stops_the_monitor_started_from_config(ray_session, varied_model_dir):
    from spillover.infra.config.engines import EnginesConfig
    from spillover.rollout.fleet.manager import RolloutManager

    m = RolloutManager(EnginesConfig(rollout_num_gpus=1, max_running_requests=4, health_interval_s=0.2),
                       varied_model_dir, use_gpu=False)
    assert health_monitor_running(m)  # what it does when an engine hangs: the test above
    checks, real_check = [], m._health_check

    async def counted_check():
        checks.append(await real_check())
        return checks[-1]

    m._health_check = counted_check  # the monitor looks it up at each check
    wait_for(lambda: len(checks), 30, "3 checks of the monitor started from config", every=0.02,
             until=lambda n: n >= 3)
    assert health_monitor_running(m) and m.restarts == 0 and all(c == {0: "ok"} for c in checks), checks
    pids = [pid for h in m.engines for pid in h.pids]
    router_pid, router_url, urls = m.router.proc.pid, m.router.url, list(m.urls)
    m.shutdown()
    m.shutdown()  # a second call is a no-op
    assert not health_monitor_running(m)

    def alive() -> list[int]:
        return [p for p in [*pids, router_pid] if running(p)]

    wait_for(alive, 15, "the engines and the router gone", until=lambda left: not left)
    for url in [router_url, *urls]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


def test_requests_failed_by_the_router_are_retried_after_recovery(tiny_model_dir, torch_engines):
    """The manager's own retry path, with the router's retries off: a worker that refuses connections makes
    the router answer 5xx; the generator runs recover() (here: take the dead worker off) and resends."""
    import asyncio

    from spillover.rollout.fleet.router import Router
    from spillover.rollout.torch_engine.server import TorchEngineServer
    from spillover.rollout.fleet.generation import BatchGenerator
    from spillover.rollout.fleet.pinned_router import PinnedRouter

    victim = TorchEngineServer(str(tiny_model_dir), max_running_requests=4)
    victim.start()
    router = Router.launch(extra_args=["--disable-retries"])
    try:
        router.add_worker(torch_engines[0].url)
        router.add_worker(victim.url)
        victim.stop()  # its port now refuses connections
        recoveries: list[int] = []

        async def recover() -> None:
            recoveries.append(1)
            await asyncio.to_thread(router.remove_worker, victim.url)

        async def run() -> list[GenerateResponse]:
            async with EngineClient(router.url) as via_router, EngineClient(torch_engines[0].url) as live:
                unpinned = PinnedRouter(via_router, lambda engine: None, lambda url: live)
                gen = BatchGenerator(unpinned, lambda: [live.url], lambda url: live, recover, max_attempts=3)
                return await gen.generate_round(batch(GREEDY))

        results = asyncio.run(run())
        assert recoveries, "no request failed: the router never sent one to the dead worker"
        assert all(r.meta_info.finish_reason.type in ("stop", "length") for r in results)
    finally:
        router.stop()


def test_more_slots_than_the_cluster_has_fails_at_once_naming_the_field(ray_session, tiny_model_dir):
    from spillover.infra.config.engines import EnginesConfig
    from ray.util import placement_group_table

    from spillover.rollout.fleet.engine_pool import EnginePool

    too_many = EnginesConfig(rollout_num_gpus=4, num_cpus_per_engine=1000)
    groups = len(placement_group_table())
    with pytest.raises(RuntimeError, match="engines.rollout_num_gpus=4 needs CPU"):
        EnginePool(too_many, tiny_model_dir, use_gpu=False)
    assert len(placement_group_table()) == groups  # refused before asking for a placement group (and waiting on it)
