"""The torch engine's /pause_generation modes over real HTTP, as SGLang 0.5.23 defines them
(tests/data/sglang_contract/http_routes.json): abort returns every request with its partial output; retract frees
the running requests' KV cache and recomputes it on /continue_generation; in_place keeps it. Weights loaded while
paused apply at once, the tokens after carry the new version, and SGLang's meta_info.weight_versions spans say so
(on every answer, as SGLang's: each token labelled with the weights that made it).
A request paused and continued (in_place or retract) under unchanged weights gives the same tokens as one never
paused: the pause loses nothing."""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import torch

from spillover.rollout.drivers.requests import parse_responses
from spillover.rollout.fleet.engine_client import EngineClient
from spillover.rollout.sglang.backend import serialize_named_tensors
from spillover.rollout.sglang.protocol import GenerateRequest, GenerateResponse
from spillover.rollout.torch_engine.server import TorchEngineServer

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(varied_model_dir):
    server = TorchEngineServer(str(varied_model_dir), max_running_requests=4, seed=0)
    server.start()
    yield server
    server.stop()


def running_output_length(engine: TorchEngineServer) -> int:
    requests = list(engine.batcher.running.values()) + list(engine.batcher.waiting)
    return len(requests[0].output_ids) if requests else 0


async def until_generating(engine: TorchEngineServer, at_least: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while running_output_length(engine) < at_least:
        assert time.monotonic() < deadline, f"the request did not reach {at_least} tokens in {timeout_s} s"
        await asyncio.sleep(0.001)


async def paused_run(engine: TorchEngineServer, mode: str, while_paused) -> tuple[dict, int, object]:
    """Generate PROMPT greedily, pause `mode` once a few tokens exist, run while_paused(client), continue.
    -> (the answer as JSON, output tokens when paused, what while_paused returned)."""
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
        answer = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                                    "return_logprob": True}))
        await until_generating(engine, 3)
        assert (await client.post("/pause_generation", json={"mode": mode})).status_code == 200
        at_pause = running_output_length(engine)
        during = await while_paused(client)
        assert running_output_length(engine) == at_pause, "a step ran while paused"
        assert (await client.post("/continue_generation", json={})).status_code == 200
        return (await answer).json(), at_pause, during


def greedy_reference(engine: TorchEngineServer) -> list[int]:
    async def once():
        async with EngineClient(engine.url) as client:
            return (await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY))).output_ids
    return asyncio.run(once())


async def bump_version(client: httpx.AsyncClient, version: str) -> None:
    response = await client.post("/update_weight_version", json={"new_version": version, "abort_all_requests": False})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_paused_request_continues_with_the_same_tokens_and_reports_the_version_spans(engine, mode):
    reference = greedy_reference(engine)

    async def while_paused(client):
        kv_held = len(engine.batcher.running)
        flushed = await client.post("/flush_cache")
        ready = (await client.get("/ready")).status_code
        await bump_version(client, "7")
        return kv_held, flushed.status_code, ready

    answer, at_pause, (kv_held, flushed, ready) = asyncio.run(paused_run(engine, mode, while_paused))
    assert answer["output_ids"] == reference
    assert answer["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": at_pause},
                                                      {"version": "7", "start": at_pause, "end": len(reference)}]
    assert answer["meta_info"]["weight_version"] == "7"
    assert ready == 503
    if mode == "in_place":  # the request keeps its slot and KV cache: SGLang refuses the flush
        assert (kv_held, flushed) == (1, 400)
    else:  # retracted: no KV cache held, the flush is allowed
        assert (kv_held, flushed) == (0, 200)
    asyncio.run(bump_version_back(engine))


async def bump_version_back(engine: TorchEngineServer) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        await bump_version(client, "0")
        assert (await client.get("/ready")).status_code == 200


def test_pause_abort_returns_the_partial_output_and_holds_new_requests_until_continue(engine):
    reference = greedy_reference(engine)

    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as late_client:
            async def while_paused(client):
                late = asyncio.create_task(late_client.post("/generate", json={"input_ids": PROMPT,
                                                                               "sampling_params": GREEDY}))
                await asyncio.sleep(0.2)  # the late request is queued, not run
                return late, engine.batcher.counts()

            answer, at_pause, (late, queued) = await paused_run(engine, "abort", while_paused)
            return answer, at_pause, queued, (await late).json()

    answer, at_pause, queued, late = asyncio.run(scenario())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["output_ids"] == reference[:len(answer["output_ids"])] and 3 <= len(answer["output_ids"]) < 40
    assert queued == (0, 1)
    assert late["output_ids"] == reference
    # as SGLang 0.5.23: spans on every finished answer, also one that lived through no update
    assert late["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 40}]
    assert answer["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": len(answer["output_ids"])}]


def test_weights_loaded_while_paused_in_place_need_flush_cache_false(engine, varied_model_dir):
    """SGLang loads the weights, then fails the cache flush while in-place requests hold KV cache: success false
    with flush_cache=true, success with flush_cache=false; the tokens after the load carry its version."""
    weights = engine.batcher.decoder.weights
    name = "model.norm.weight"
    original = weights[name].clone()

    def update(version: int, flush_cache: bool, scale: float) -> dict:
        entries = serialize_named_tensors([(name, original * scale)], tp_size=1, backend="torch")
        return {"serialized_named_tensors": entries, "weight_version": version, "flush_cache": flush_cache}

    async def while_paused(client):
        outcomes = []
        assert (await client.post("/begin_weight_update", json={})).status_code == 200
        for version, flush, scale in ((3, True, 1.5), (4, False, 1.0)):
            response = await client.post("/update_weights_from_tensor", json=update(version, flush, scale))
            outcomes.append((response.status_code, response.json()["success"], weights[name][0].item()))
        assert (await client.post("/end_weight_update", json={})).status_code == 200
        return outcomes

    answer, at_pause, outcomes = asyncio.run(paused_run(engine, "in_place", while_paused))
    assert outcomes[0][:2] == (400, False) and outcomes[0][2] == pytest.approx(original[0].item() * 1.5)
    assert outcomes[1][:2] == (200, True) and outcomes[1][2] == pytest.approx(original[0].item())
    assert answer["meta_info"]["weight_versions"][-1] == {"version": "4", "start": at_pause, "end": 40}
    assert torch.equal(weights[name], original)
    asyncio.run(bump_version_back(engine))


def token_labels(answer: dict) -> list[int]:
    """Each output token's weight version as the dock stores it (parse_responses reads the spans)."""
    _, _, _, versions = parse_responses([GenerateResponse.model_validate(answer)], default_version=-1)
    return np.broadcast_to(versions[0], (len(answer["output_ids"]),)).tolist()


def test_every_token_of_an_in_place_pause_is_labelled_with_the_weights_that_made_it(engine, varied_model_dir):
    """Issue 37: weights that pick the least likely token (the final norm negated: the same keys and values, every
    logit negated) load while a request is paused in_place mid-generation; each token's label, read from the answer's
    spans as the dock reads them, is the version whose greedy pick the token is (old: argmax, new: argmin of the old
    weights' logits over the same prefix), the last token before the pause included."""
    from spillover.bench.reference_lm import load_causal_lm

    name = "model.norm.weight"
    original = engine.batcher.decoder.weights[name].clone()

    async def load(client: httpx.AsyncClient, tensor: torch.Tensor, version: int) -> None:
        entries = serialize_named_tensors([(name, tensor)], tp_size=1, backend="torch")
        assert (await client.post("/begin_weight_update", json={})).status_code == 200
        response = await client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": entries, "weight_version": version, "flush_cache": False})
        assert (await client.post("/end_weight_update", json={})).status_code == 200
        assert response.status_code == 200, response.text

    async def restore() -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
            await load(client, original, 0)

    try:
        answer, at_pause, _ = asyncio.run(paused_run(engine, "in_place", lambda client: load(client, -original, 5)))
    finally:
        asyncio.run(restore())
    out = answer["output_ids"]
    with torch.no_grad():
        logits = load_causal_lm(varied_model_dir).eval()(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1]
    made_by = [0 if token == int(row.argmax()) else 5 if token == int(row.argmin()) else None
               for token, row in zip(out, logits)]
    assert made_by == [0] * at_pause + [5] * (len(out) - at_pause)
    assert token_labels(answer) == made_by
    assert answer["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": at_pause},
                                                      {"version": "5", "start": at_pause, "end": len(out)}]
    assert torch.equal(engine.batcher.decoder.weights[name], original)


def test_a_request_aborted_after_an_in_place_update_keeps_the_version_that_made_its_tokens(engine):
    """Paused in_place, the version changes, the request is aborted before another step: SGLang's spans (and
    weight_version) name the old version only, the one whose weights made every token."""
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
            answer = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                                        "return_logprob": True}))
            await until_generating(engine, 3)
            assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            at_pause = running_output_length(engine)
            await bump_version(client, "7")
            assert (await client.post("/abort_request", json={"abort_all": True})).status_code == 200
            result = (await answer).json()
            assert (await client.post("/continue_generation", json={})).status_code == 200
            return result, at_pause

    answer, at_pause = asyncio.run(scenario())
    asyncio.run(bump_version_back(engine))
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and len(answer["output_ids"]) == at_pause
    assert answer["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": at_pause}]
    assert answer["meta_info"]["weight_version"] == "0" and token_labels(answer) == [0] * at_pause


def test_an_unknown_pause_mode_is_refused_naming_the_field(engine):
    response = httpx.post(engine.url + "/pause_generation", json={"mode": "freeze"})
    assert response.status_code == 400 and "mode" in response.json()["message"]
    assert httpx.get(engine.url + "/ready").status_code == 200  # not paused
