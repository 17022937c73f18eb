"""The torch engine server over real HTTP: correctness against HF, abort/continue, weight updates,
bad requests, control endpoints, and requests through the real sglang-router (session fixtures)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import httpx
import pytest
import torch

from spillover.rollout.fleet.engine_client import EngineClient, EngineError, EngineUnreachable
from spillover.rollout.sglang.protocol import GenerateRequest, GenerateResponse
from spillover.rollout.torch_engine.server import TorchEngineServer
from waiting import wait_for

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 3], [40, 2, 2, 11, 30, 31, 12], [17], [33, 34, 35, 36], [9, 8, 7]]


@pytest.fixture(scope="module")
def varied_engine(varied_model_dir):
    server = TorchEngineServer(str(varied_model_dir), max_running_requests=8, seed=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def varied_hf(varied_model_dir):
    from spillover.bench.reference_lm import load_causal_lm

    return load_causal_lm(varied_model_dir).eval()


def run(coro):
    return asyncio.run(coro)


def ask(client: EngineClient, input_ids: list[int], params: dict, rid: str | None = None,
        return_logprob: bool = True) -> Awaitable[GenerateResponse]:
    """One /generate call through the client, with logprobs unless told not to."""
    named = {} if rid is None else {"rid": rid}
    return client.generate(GenerateRequest(input_ids=input_ids, sampling_params=params, return_logprob=return_logprob,
                                           **named))


async def generate_all(url: str, prompts, params: dict, return_logprob: bool = True):
    async with EngineClient(url) as client:
        return await asyncio.gather(*[ask(client, p, params, return_logprob=return_logprob) for p in prompts])


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int = 1) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_matches_hf_generate(varied_engine, varied_hf):
    results = run(generate_all(varied_engine.url, PROMPTS, {"max_new_tokens": 24, "temperature": 0}))
    saw_stop = False
    for prompt, res in zip(PROMPTS, results):
        expected = hf_greedy(varied_hf, prompt, 24)
        assert res.output_ids == expected
        assert res.meta_info.completion_tokens == len(res.output_ids)
        assert res.meta_info.prompt_tokens == len(prompt)
        if res.meta_info.finish_reason.type == "stop":
            saw_stop = True
            assert res.output_ids[-1] == 1 and res.meta_info.finish_reason.matched == 1
        else:
            assert res.meta_info.finish_reason.type == "length" and len(res.output_ids) == 24
    assert saw_stop, "the varied model should hit EOS on some prompt"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_forward(varied_engine, varied_hf, temperature):
    params = {"max_new_tokens": 16, "temperature": temperature, "ignore_eos": True}
    results = run(generate_all(varied_engine.url, PROMPTS[:4], params))
    for prompt, res in zip(PROMPTS, results):
        ids = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():
            logits = varied_hf(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / (temperature or 1.0), -1).gather(
            1, torch.tensor(res.output_ids).unsqueeze(1)).squeeze(1)
        got = torch.tensor(res.meta_info.logprobs)
        assert [e[1] for e in res.meta_info.output_token_logprobs] == res.output_ids
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_eos_on_last_allowed_position_reports_stop(varied_engine, varied_hf):
    """SGLang 0.5.23 (../shared/sglang-contract): stop before length, the EOS included."""
    prompt = next(p for p in PROMPTS if 1 in hf_greedy(varied_hf, p, 24))
    n = hf_greedy(varied_hf, prompt, 24).index(1) + 1
    res = run(generate_all(varied_engine.url, [prompt], {"max_new_tokens": n, "temperature": 0}))[0]
    assert res.output_ids[-1] == 1 and len(res.output_ids) == n
    assert res.meta_info.finish_reason.type == "stop" and res.meta_info.finish_reason.matched == 1


async def cut_after(client, engine, prompt, params, rid: str, tokens: int, abort_rid: str | None = None):
    """Generate, abort once `tokens` are out (by abort_rid: a prefix matches, as in SGLang) -> the aborted response."""
    task = asyncio.create_task(ask(client, prompt, params, rid=rid))
    while not engine.batcher.running or len(next(iter(engine.batcher.running.values())).output_ids) < tokens:
        await asyncio.sleep(0.002)
    await client.abort(abort_rid or rid)
    return await task


def test_abort_mid_generation_then_continue_matches_uninterrupted(varied_engine):
    prompt, total = [5, 6, 7, 8, 9], 400
    params = {"max_new_tokens": total, "temperature": 0, "ignore_eos": True}

    async def scenario():
        async with EngineClient(varied_engine.url) as client:
            full = await ask(client, prompt, params)
            partial = await cut_after(client, varied_engine, prompt, params, "ab" * 16, 20, abort_rid="ab" * 4)
            rest = await ask(client, prompt + partial.output_ids,
                             {**params, "max_new_tokens": total - len(partial.output_ids)})
            return full, partial, rest

    full, partial, rest = run(scenario())
    assert partial.meta_info.finish_reason.type == "abort"
    assert 20 <= len(partial.output_ids) < total
    assert len(partial.meta_info.output_token_logprobs) == len(partial.output_ids)
    assert partial.output_ids + rest.output_ids == full.output_ids


def test_abort_queued_request_returns_no_tokens(varied_engine):
    async def scenario():
        async with EngineClient(varied_engine.url) as client:
            await client.post("/pause_generation", json={"mode": "in_place"})
            task = asyncio.create_task(ask(client, [5, 6], {"max_new_tokens": 8}))
            while varied_engine.batcher.counts()[1] == 0:
                await asyncio.sleep(0.002)
            await client.abort(abort_all=True)
            res = await task
            await client.post("/continue_generation")
            after = await ask(client, [5, 6], {"max_new_tokens": 3})
            return res, after

    res, after = run(scenario())
    assert res.output_ids == [] and res.meta_info.finish_reason.type == "abort"
    assert res.meta_info.completion_tokens == 0
    assert after.meta_info.completion_tokens == 3


def test_weight_update_from_disk_and_in_process(varied_engine, tiny_model_dir, varied_model_dir):
    from spillover.rollout.torch_engine.lean_forward import read_safetensors

    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    before = run(generate_all(varied_engine.url, PROMPTS[:3], params))
    varied_engine.load_weights(read_safetensors(tiny_model_dir), weight_version=7)
    tiny = run(generate_all(varied_engine.url, PROMPTS[:3], params))
    assert [r.output_ids for r in tiny] != [r.output_ids for r in before]
    assert all(r.meta_info.weight_version == 7 for r in tiny)

    async def from_disk():
        async with EngineClient(varied_engine.url) as client:
            resp = await client.update_weights_from_disk(str(varied_model_dir), weight_version=8)
            return resp, await client.weight_version(), (await client.get("/get_weight_version")).json()

    resp, version, raw = run(from_disk())
    assert resp.success and version == 8 and raw["weight_version"] == "8"  # text on the wire, as SGLang
    after = run(generate_all(varied_engine.url, PROMPTS[:3], params))
    assert [r.output_ids for r in after] == [r.output_ids for r in before]
    assert all(r.meta_info.weight_version == 8 for r in after)
    bad = httpx.post(varied_engine.url + "/update_weights_from_disk", json={"model_path": "/nonexistent/x"})
    assert bad.status_code == 400 and bad.json()["success"] is False


BAD_REQUESTS = [
    ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [5] * 600}, "context length"),
    ({"input_ids": [5, 99999]}, "vocabulary"),
]


def test_bad_requests_get_400_and_do_not_disturb_others(sglang_router, torch_engines):
    """Engines answer 400 naming the field; through the router the same body gets a 4xx (the router
    itself refuses some bodies, e.g. a negative max_new_tokens, with 422 before any engine sees them)."""
    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    engine_urls = [s.url for s in torch_engines]

    async def scenario():
        async with EngineClient(sglang_router.url) as client, httpx.AsyncClient() as raw:
            good = [asyncio.create_task(ask(client, p, params)) for p in PROMPTS]
            await asyncio.sleep(0.05)
            direct = await asyncio.gather(*[raw.post(url + "/generate", json=body)
                                            for url in engine_urls for body, _ in BAD_REQUESTS])
            routed = await asyncio.gather(*[raw.post(sglang_router.url + "/generate", json=body)
                                            for body, _ in BAD_REQUESTS])
            return await asyncio.gather(*good), direct, routed

    good, direct, routed = run(scenario())
    for resp, (_, needle) in zip(direct, BAD_REQUESTS * len(engine_urls)):
        assert resp.status_code == 400, resp.text
        assert needle in resp.json()["message"]
    for resp, (_, needle) in zip(routed, BAD_REQUESTS):
        assert resp.status_code in (400, 422) and needle in resp.text, resp.text
    assert all(r.meta_info.completion_tokens == 200 for r in good)
    assert all(s.batcher.alive for s in torch_engines)


def test_requests_through_router_reach_both_engines(sglang_router, torch_engines, tiny_model_dir):
    from spillover.bench.reference_lm import load_causal_lm

    before = [s.batcher.generated_tokens for s in torch_engines]
    results = run(generate_all(sglang_router.url, PROMPTS * 2, {"max_new_tokens": 8, "temperature": 0}))
    assert all(s.batcher.generated_tokens > b for s, b in zip(torch_engines, before))
    model = load_causal_lm(tiny_model_dir).eval()
    for prompt, res in zip(PROMPTS * 2, results):
        assert res.output_ids == hf_greedy(model, prompt, 8)


def test_control_endpoints(varied_engine):
    url = varied_engine.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate").status_code == 200
    assert httpx.post(url + "/flush_cache").status_code == 200
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = run(generate_all(url, [[5, 6]], greedy))[0].output_ids
    assert httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert varied_engine.batcher.cache is None and varied_engine.memory_bytes()["weights"] > 0
    assert httpx.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert run(generate_all(url, [[5, 6]], greedy))[0].output_ids == before  # the weights stayed
    assert httpx.post(url + "/release_memory_occupation", json={}).status_code == 200  # everything, weights too
    assert varied_engine.memory_bytes() == {"weights": 0, "kv_cache": 0}
    assert httpx.post(url + "/generate", json={"input_ids": [5, 6]}).status_code == 503
    assert httpx.post(url + "/resume_memory_occupation", json={}).status_code == 200
    loads = httpx.get(url + "/v1/loads").json()
    assert loads["loads"][0]["num_running_reqs"] == 0 and loads["aggregate"]["total_reqs"] == 0
    info = httpx.get(url + "/model_info").json()
    assert info["model_path"] and "weight_version" in info
    assert run(generate_all(url, [[5, 6]], greedy))[0].output_ids != before  # resumed weights are empty (zeros)
    reload = {"model_path": varied_engine.model_path, "weight_version": info["weight_version"]}
    assert httpx.post(url + "/update_weights_from_disk", json=reload, timeout=60).json()["success"]
    assert run(generate_all(url, [[5, 6]], greedy))[0].output_ids == before

    async def busy_release():
        async with EngineClient(url) as client:
            task = asyncio.create_task(ask(client, [5], {"max_new_tokens": 300, "ignore_eos": True}))
            while not varied_engine.batcher.running:
                await asyncio.sleep(0.002)
            with pytest.raises(EngineError) as err:
                await client.post("/release_memory_occupation", json={})
            await task
            return err.value

    err = run(busy_release())
    assert err.status == 400 and "idle" in err.message


def test_sampling_is_seeded_and_respects_top_k(varied_engine):
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_k": 1, "ignore_eos": True}
    sampled = run(generate_all(varied_engine.url, PROMPTS[:3], params))
    greedy = run(generate_all(varied_engine.url, PROMPTS[:3], {**params, "temperature": 0}))
    assert [r.output_ids for r in sampled] == [r.output_ids for r in greedy]
    steps = varied_engine.batcher.steps
    free = run(generate_all(varied_engine.url, PROMPTS[:3] * 4, {**params, "top_k": -1, "top_p": 0.9}))
    # 12 requests of 16 tokens in 8 slots decode side by side (~2 x 16 steps), not one after another (12 x 16)
    assert varied_engine.batcher.steps - steps < 4 * 16
    assert len({tuple(r.output_ids) for r in free}) > 3


def test_a_client_without_an_engine_raises_engine_unreachable():
    from spillover.rollout.fleet.router import free_port

    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{free_port()}") as client:
            assert await client.health() is False
            with pytest.raises(EngineUnreachable):
                await ask(client, [5], {"max_new_tokens": 1})

    run(scenario())


def test_client_disconnect_aborts_its_request(varied_engine):
    async def scenario():
        async with EngineClient(varied_engine.url) as client:
            await client.post("/pause_generation", json={"mode": "in_place"})  # hold it: only an abort removes it
            task = asyncio.create_task(ask(client, [5, 6], {"max_new_tokens": 8}))
            while varied_engine.batcher.counts() == (0, 0):
                await asyncio.sleep(0.002)
            task.cancel()  # closes the connection mid-request
            try:
                await asyncio.to_thread(wait_for, varied_engine.batcher.counts, 5, "the engine holds no request",
                                        every=0.01, until=lambda counts: counts == (0, 0))
            finally:
                await client.post("/continue_generation")

    run(scenario())


def greedy_tokens(model, ids: list[int], count: int) -> list[int]:
    """count argmax tokens after ids, EOS or not (as ignore_eos)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-count:]


def test_a_row_carried_across_a_weight_update_continues_under_the_new_weights(varied_engine, varied_hf,
                                                                               varied_model_dir, tiny_model_dir):
    """Partial rollout's carried row (issue 13, cache consistency): cut under version 1, the weights change, and its
    continuation is computed from the new weights alone -- no key/value state of the old ones is reused
    (cached_tokens 0), its tokens carry version 2, and they are what HF generates from prompt + kept tokens with
    the new weights, not with the old ones."""
    from spillover.bench.reference_lm import load_causal_lm
    from spillover.rollout.torch_engine.lean_forward import read_safetensors

    prompt, total, rest_len = [5, 6, 7, 8, 9], 200, 12
    params = {"max_new_tokens": total, "temperature": 0, "ignore_eos": True}
    varied_engine.load_weights(read_safetensors(varied_model_dir), weight_version=1)

    async def scenario():
        async with EngineClient(varied_engine.url) as client:
            partial = await cut_after(client, varied_engine, prompt, params, "cd" * 16, 8)
            varied_engine.load_weights(read_safetensors(tiny_model_dir), weight_version=2)
            rest = await ask(client, prompt + partial.output_ids, {**params, "max_new_tokens": rest_len})
            return partial, rest

    try:
        partial, rest = run(scenario())
    finally:  # the module's engine serves the varied weights to whatever runs next
        varied_engine.load_weights(read_safetensors(varied_model_dir), weight_version=0)
    kept = prompt + partial.output_ids
    assert partial.meta_info.finish_reason.type == "abort" and partial.meta_info.weight_version == 1
    assert rest.meta_info.weight_version == 2 and rest.meta_info.cached_tokens == 0
    new = greedy_tokens(load_causal_lm(tiny_model_dir).eval(), kept, rest_len)
    old = greedy_tokens(varied_hf, kept, rest_len)
    assert new != old  # the two weight sets disagree here, so the check below can tell them apart
    assert rest.output_ids == new


def test_unknown_sampling_keys_are_refused_as_sglang_does(varied_engine):
    """SGLang's /generate gate answers 400 to a sampling_params key it does not know, naming it; a key SGLang knows
    but this engine does not implement is refused unless at its default; null means the default."""
    url = varied_engine.url
    base = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    for key, value, needles in (("temprature", 0.5, ["unknown field `temprature`"]),
                                ("seed", 3, ["unknown field `seed`", "sampling_seed"]),
                                ("repetition_penalty", 1.3, ["repetition_penalty", "not implemented"])):
        r = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": {**base, key: value}})
        assert r.status_code == 400 and all(n in r.json()["message"] for n in needles), r.text
    plain = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": base}).json()["output_ids"]
    quiet = {**base, "repetition_penalty": 1.0, "n": 1, "top_p": None, "temperature": 0}
    same = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": quiet}).json()["output_ids"]
    assert same == plain
    uncapped = {"temperature": 0, "ignore_eos": True, "max_new_tokens": None}
    answer = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": uncapped}, timeout=60).json()
    assert len(answer["output_ids"]) == varied_engine.max_len - 2  # null: up to the context length


def test_a_released_engine_fails_health_as_sglang(varied_engine, monkeypatch):
    """SGLang's /health and /health_generate run a 1-token generation, which a released engine cannot do: both
    fail until resume (SGLang's server dies; ours answers 503). With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 in
    the server's environment, /health answers 200 at once."""
    url = varied_engine.url
    assert httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    try:
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 503
        monkeypatch.setattr(varied_engine, "health_generation", False)
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        monkeypatch.undo()
    finally:
        assert httpx.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


def test_an_empty_tag_list_releases_and_resumes_everything_as_sglang(varied_engine, varied_model_dir):
    """SGLang 0.5.23 reads tags [] as every tag (weight_updater: `if tags is None or len(tags) == 0`)."""
    url = varied_engine.url
    assert httpx.post(url + "/release_memory_occupation", json={"tags": []}).status_code == 200
    try:
        assert varied_engine.batcher.released and not varied_engine.batcher.decoder.weights
    finally:
        assert httpx.post(url + "/resume_memory_occupation", json={"tags": []}).status_code == 200
        reload = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(varied_model_dir)}, timeout=60)
        assert reload.status_code == 200, reload.text  # resumed weights are zeros until loaded, as SGLang's
    assert not varied_engine.batcher.released


def test_an_abort_left_in_an_idle_engine_does_not_fail_the_probe(varied_engine, monkeypatch):
    """An abort (generation's end-of-round one) still in the idle engine's inbox looks like waiting work; once the loop
    has taken it there is none, so the probe makes its own 1-token step instead of waiting for one that never comes
    (which failed the probe and restarted a healthy engine)."""
    from spillover.rollout.torch_engine import http_app

    monkeypatch.setattr(http_app, "HEALTH_TIMEOUT_S", 3.0)
    varied_engine.batcher._inbox.put(("abort", "", True))  # not woken: the loop sees it at its next idle tick
    assert httpx.get(varied_engine.url + "/health_generate", timeout=30).status_code == 200


def test_a_paused_engine_answers_no_generation_probe_as_sglang(varied_engine, monkeypatch):
    """SGLang's probe is a request like any other: a paused engine parks it, and /health (by default) and
    /health_generate get no answer (SGLang's gives up after 20 s with 503). With the generation probe off, /health
    answers at once; after continue, both answer."""
    from spillover.rollout.sglang.backend import ENGINE_ENV
    from spillover.rollout.torch_engine.server import TorchEngineServer

    url = varied_engine.url
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        for route in ("/health", "/health_generate"):
            with pytest.raises(httpx.TimeoutException):
                httpx.get(url + route, timeout=1.5)
        monkeypatch.setattr(varied_engine, "health_generation", False)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        monkeypatch.undo()
    finally:
        assert httpx.post(url + "/continue_generation", json={}).status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    # the server reads the variable as SGLang does, from the environment it is given (the fleet's: ENGINE_ENV)
    assert not TorchEngineServer(varied_engine.model_path, env=ENGINE_ENV).health_generation
    assert TorchEngineServer(varied_engine.model_path, env={}).health_generation
