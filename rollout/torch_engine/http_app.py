"""The FastAPI routes of the torch engine server: SGLang's native API subset (see protocol.py).

Errors follow SGLang's shape: HTTP 400 with {"object": "error", "message", "type", "param", "code"}.
"""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..sglang.protocol import (AbortRequest, BadRequest, ContinueGenerationRequest, GenerateRequest, LoadEntry,
                               LoadsResponse, ModelInfo, PauseGenerationRequest, ReleaseMemoryOccupationRequest,
                               ResumeMemoryOccupationRequest, UpdateWeightsFromDiskRequest, WeightVersionInfo, new_rid)
from .served_engine import ServedEngine

ENGINE_VERSION = "spillover-torch-0.1"
HEALTH_TIMEOUT_S = 20.0


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": "BadRequest" if status == 400 else "Error",
                         "param": None, "code": status}, status_code=status)


def memory_event(kind: str, tags: list[str] | None) -> str:
    """A memory_events entry: "release" / "resume" (every tag), or e.g. "resume:weights" (those tags only)."""
    return kind if tags is None else f"{kind}:{','.join(tags)}"


def validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{field}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    return orjson.loads(raw)


async def wait_disconnect(request: Request) -> None:
    """Returns once the client has disconnected (after the body is read, receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(server: ServedEngine) -> FastAPI:
    app = FastAPI(title="spillover torch engine", openapi_url=None)
    batcher = server.batcher

    async def parse(request: Request, model):
        try:
            return model.model_validate(await read_json(request)), None
        except orjson.JSONDecodeError as err:
            return None, error_response(f"request body is not valid JSON: {err}")
        except ValidationError as err:
            return None, error_response(validation_message(err))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body, err = await parse(request, GenerateRequest)
        if err is not None:
            return err
        if batcher.released:
            return error_response("the engine's memory is released (release_memory_occupation): "
                                  "resume_memory_occupation first", 503)
        try:
            engine_req = server.make_request(body)
        except BadRequest as bad:
            return error_response(str(bad))
        server.live_rids.add(engine_req.rid)
        result_future = asyncio.wrap_future(batcher.submit(engine_req))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait((result_future, gone), return_when=asyncio.FIRST_COMPLETED)
            if not result_future.done():  # the caller went away: free the slot, as SGLang does
                batcher.abort(engine_req.rid)
                return Response(status_code=499)
            result = result_future.result()
        except Exception as failure:
            return error_response(f"generation failed: {failure}", 500)
        finally:
            gone.cancel()
            server.live_rids.discard(engine_req.rid)
        text = server.decode_text(result.output_ids, body.sampling_params.skip_special_tokens)
        if text is not None:
            result.text = text
        return Response(result.model_dump_json(exclude_unset=True), media_type="application/json")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body, err = await parse(request, AbortRequest)
        if err is not None:
            return err
        batcher.abort(body.rid, body.abort_all)
        return Response(status_code=200)

    async def probe_generation() -> Response:
        """SGLang's health handler: 200 when the engine can generate a token (a 1-token generation when idle, else
        a step of the requests it runs), 503 otherwise: dead, or memory released (SGLang would run the probe on
        freed memory and die). A paused engine makes no step: the probe waits HEALTH_TIMEOUT_S and fails, as
        SGLang's (its probe request is parked with the others)."""
        if not batcher.alive or batcher.released:
            return Response(status_code=503)
        tic = time.monotonic()
        deadline = tic + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if batcher.heartbeat > tic:
                return Response(status_code=200)
            running, waiting = batcher.counts()
            # idle (also once what looked like work, e.g. an abort in the inbox, turned out to be none): no step
            # would come, so a 1-token probe must make one
            if not (running or waiting or batcher.paused):
                probe = server.make_request(GenerateRequest(input_ids=[0], rid=f"HEALTH_CHECK_{new_rid()}",
                                                            sampling_params={"max_new_tokens": 1, "temperature": 0}))
                try:
                    await asyncio.wait_for(asyncio.wrap_future(batcher.submit(probe)), deadline - time.monotonic())
                    return Response(status_code=200)
                except Exception:
                    batcher.abort(probe.rid)
                    return Response(status_code=503)
            await asyncio.sleep(0.01)
        return Response(status_code=503)

    @app.get("/health")
    async def health():
        """As SGLang's /health: the generation probe, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (then 200
        while the engine runs, paused or released or not)."""
        if not server.health_generation:
            return Response(status_code=200 if batcher.alive else 503)
        return await probe_generation()

    @app.get("/health_generate")
    async def health_generate():
        return await probe_generation()

    @app.get("/v1/loads")
    async def loads():
        running, waiting = batcher.counts()
        used = sum(len(r.input_ids) + len(r.output_ids) for r in list(batcher.running.values()))
        total = batcher.num_slots * batcher.max_len
        entry = LoadEntry(dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                          num_total_reqs=running + waiting, num_used_tokens=used, num_total_tokens=total,
                          token_usage=round(used / total, 4), gen_throughput=0.0,
                          utilization=round(running / batcher.num_slots, 4))
        aggregate = {"total_running_reqs": running, "total_waiting_reqs": waiting, "total_reqs": running + waiting,
                     "total_used_tokens": used, "total_tokens": total, "avg_token_usage": entry.token_usage,
                     "avg_throughput": 0.0, "avg_utilization": entry.utilization}
        return LoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=ENGINE_VERSION, dp_rank_count=1,
                             loads=[entry], aggregate=aggregate).model_dump()

    def model_info() -> dict:
        return ModelInfo(model_path=server.model_path, tokenizer_path=server.model_path,
                         weight_version=server.weight_version).model_dump(mode="json")

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    @app.get("/get_weight_version")
    async def get_weight_version():
        return WeightVersionInfo(weight_version=server.weight_version).model_dump(mode="json")

    def server_info() -> dict:
        return {**model_info(), "max_running_requests": batcher.num_slots, "context_length": server.max_len,
                "device": str(server.device), "version": ENGINE_VERSION, "backend": "torch"}

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    async def when_idle(action, name: str):
        """Run action on the engine thread if no request runs or waits; else a 400 naming the fix."""
        def guarded():
            if batcher.running or batcher.waiting:
                raise RuntimeError(f"{name} needs an idle engine: abort or finish the running requests first")
            return action()
        try:
            await asyncio.wrap_future(batcher.call(guarded))
        except RuntimeError as err:
            return error_response(str(err))
        return None

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """Refused while a request holds KV cache (running, or paused in place); requests retracted by a pause hold
        none."""
        def guarded():
            if batcher.running or (batcher.waiting and not batcher.paused):
                raise RuntimeError("flush_cache needs an idle engine (requests paused in_place keep their KV cache): "
                                   "finish or abort them first, or pause with mode retract")
        try:
            await asyncio.wrap_future(batcher.call(guarded))
        except RuntimeError as err:
            return error_response(str(err))
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body, err = await parse(request, PauseGenerationRequest)
        if err is not None:
            return err
        await asyncio.wrap_future(batcher.call(lambda: batcher.pause(body.mode)))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        _, err = await parse(request, ContinueGenerationRequest)
        if err is not None:
            return err
        await asyncio.wrap_future(batcher.call(batcher.resume))
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/ready")
    async def ready():
        """SGLang's readiness: 200 when up and not paused, 503 when paused, released or dead."""
        return Response(status_code=503 if batcher.paused or batcher.released or not batcher.alive else 200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        body, err = await parse(request, ReleaseMemoryOccupationRequest)
        if err is not None:
            return err
        tags = body.tags or None  # as SGLang: no tags and an empty list both mean every tag
        err = await when_idle(lambda: batcher.release_memory(tags), "release_memory_occupation")
        server.memory_events.append((time.monotonic(), memory_event("release", tags)))
        return err or Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        body, err = await parse(request, ResumeMemoryOccupationRequest)
        if err is not None:
            return err
        tags = body.tags or None
        await asyncio.wrap_future(batcher.call(lambda: batcher.resume_memory(tags)))
        server.memory_events.append((time.monotonic(), memory_event("resume", tags)))
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, err = await parse(request, UpdateWeightsFromDiskRequest)
        if err is not None:
            return err
        if body.abort_all_requests:
            batcher.abort(abort_all=True)
        try:
            tensors = await asyncio.to_thread(server.read_weights_from_disk, body.model_path)
            await asyncio.wrap_future(server.apply_weights_future(tensors, body.weight_version))
        except (OSError, ValueError) as failure:
            return JSONResponse({"success": False, "message": f"Failed to update weights: {failure}",
                                 "num_paused_requests": 0}, status_code=400)
        # as SGLang: the weights are loaded, but the flush fails while requests paused in_place hold KV cache
        if body.flush_cache and await asyncio.wrap_future(batcher.call(lambda: batcher.paused and
                                                                       len(batcher.running) > 0)):
            return JSONResponse({"success": False, "num_paused_requests": 0, "message": (
                "update_weights_from_disk: weights loaded, but flush_cache failed: requests paused in_place hold KV "
                "cache; send flush_cache=false with pause mode in_place")}, status_code=400)
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_json(request)
        if "new_version" not in body:
            return error_response("new_version: Field required")
        if body.get("abort_all_requests", True):  # SGLang's UpdateWeightVersionReqInput default
            batcher.abort(abort_all=True)
        await asyncio.wrap_future(batcher.call(lambda: batcher.set_weight_version(body["new_version"])))
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    from .weight_routes import add_weight_routes

    add_weight_routes(app, server, parse, read_json)
    return app
