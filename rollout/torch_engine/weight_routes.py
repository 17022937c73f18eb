"""The torch engine's routes of SGLang's distributed weight protocol (field names: SGLang 0.5.23's io_struct):

- `/init_weights_update_group` joins the trainer's broadcast group (returns after the rendezvous),
  `/destroy_weights_update_group` leaves it;
- `/begin_weight_update` and `/end_weight_update` open and close the session that SGLang 0.5.23 requires around
  `/update_weights_from_tensor` and `/update_weights_from_distributed` (outside one both answer success:false with
  HTTP 400; `/update_weights_from_disk` needs none);
- `/update_weights_from_distributed` receives one bucket by broadcast from rank 0 and loads it once running
  requests have finished (at once while paused), then sets weight_version if the request carries one (as SGLang:
  a bucket without it leaves the engine's version);
- `/update_weights_from_tensor` takes SGLang's request shape with this engine's CPU encoding of the entries, or the
  same tensors as a binary safetensors body with the other fields in the query (rollout/sglang/tensor_wire.py);
- `/get_weights_by_name` returns a parameter's first truncate_size rows (tests compare them with the learner's).

Group and weight routes answer {success, message} with 200 or 400, as SGLang's do.
"""
from __future__ import annotations

import asyncio
from typing import get_args

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..sglang.protocol import (DestroyWeightsUpdateGroupRequest, GetWeightsByNameRequest,
                               InitWeightsUpdateGroupRequest, TensorUpdateFields,
                               UpdateWeightsFromDistributedRequest, UpdateWeightsFromTensorRequest, WeightSelector)
from ..sglang.tensor_wire import SAFETENSORS_MEDIA_TYPE, decode_named_tensors, parse_safetensors
from .served_engine import ServedEngine

SELECTORS = get_args(WeightSelector)


def result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


class BodyBuffer:
    """What binary tensor bodies are read into, kept from bucket to bucket of a weight-update session and dropped at
    its end: a fresh buffer per bucket costs a page fault per 4 KiB written (2.3 s per 2 GB on these CPUs, 0.2 s into
    a kept one). `lock` is held from reading a body until its tensors, views into the buffer, are loaded."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.lock = asyncio.Lock()

    def view(self, size: int) -> memoryview:
        if len(self.blob) < size:
            self.blob = bytearray(size)  # views of the smaller one keep it alive while they live
        return memoryview(self.blob)[:size]

    def drop(self) -> None:
        self.blob = bytearray()


async def read_body(request: Request, buffer: BodyBuffer) -> memoryview:
    """The whole body, streamed into the buffer (the tensors then view it in place)."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise ValueError(f"a {SAFETENSORS_MEDIA_TYPE} body needs a Content-Length header")
    view, filled = buffer.view(int(length)), 0
    async for chunk in request.stream():
        if filled + len(chunk) > len(view):
            raise ValueError(f"the body is longer than its Content-Length ({length} bytes)")
        view[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != len(view):
        raise ValueError(f"the body ended after {filled} of its {length} bytes")
    return view


def is_safetensors(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip() == SAFETENSORS_MEDIA_TYPE


def add_weight_routes(app: FastAPI, server: ServedEngine, parse, read_json) -> None:
    """parse(request, model) -> (body, error response | None); read_json(request) -> dict (http_app's helpers)."""
    batcher = server.batcher
    body_buffer = BodyBuffer()  # binary tensor bodies, one at a time

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body, err = await parse(request, InitWeightsUpdateGroupRequest)
        if err is not None:
            return err
        try:
            await asyncio.to_thread(server.join_update_group, body)
        except Exception as failure:  # a bad backend, an unreachable master, a rendezvous timeout
            return result(False, f"Failed to initialize custom process group: {failure}")
        return result(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body, err = await parse(request, DestroyWeightsUpdateGroupRequest)
        if err is not None:
            return err
        try:
            await asyncio.to_thread(server.leave_update_group, body.group_name)
        except Exception as failure:
            return result(False, f"Failed to destroy custom process group: {failure}")
        return result(True, "Succeeded to destroy custom process group.")

    def no_session(route: str) -> JSONResponse:
        server.weight_update_events.append(f"{route} refused")
        return result(False, f"{route} needs an open weight update session: POST /begin_weight_update first")

    async def holds_kv_cache() -> bool:
        return bool(await asyncio.wrap_future(batcher.call(lambda: batcher.paused and len(batcher.running))))

    def kv_cache_kept(route: str) -> JSONResponse:
        """SGLang loads the weights, then the cache flush fails while paused in_place requests hold KV cache: the
        call reports success:false although the weights changed."""
        return result(False, f"{route}: weights loaded, but flush_cache failed: requests paused in_place hold KV "
                             "cache; send flush_cache=false with pause mode in_place")

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        selector = (await read_json(request)).get("selector", "all")
        if selector not in SELECTORS:
            return result(False, f"selector must be one of {SELECTORS}; got {selector!r}")
        if server.weight_session_open:
            return result(False, "a weight update session is already open: POST /end_weight_update first")
        server.weight_session_open = True
        server.weight_update_events.append("begin_weight_update")
        return result(True, "Weight update session opened.")

    @app.post("/end_weight_update")
    async def end_weight_update():
        if not server.weight_session_open:
            return result(False, "no weight update session is open: POST /begin_weight_update first")
        server.weight_session_open = False
        async with body_buffer.lock:
            body_buffer.drop()
        server.weight_update_events.append("end_weight_update")
        return result(True, "Weight update session closed.")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        """Two bodies. SGLang's JSON shape: serialized_named_tensors has one entry per TP rank (this engine is TP rank
        0 and reads entry 0); SGLang's entries are pickled CUDA IPC handles, this engine's are base64 text of a
        safetensors blob. Or this engine's binary form (WeightPoster sends it): Content-Type SAFETENSORS_MEDIA_TYPE,
        the blob as the body, the other fields as query parameters. Safetensors only: data, never unpickled."""
        if not is_safetensors(request):
            body, err = await parse(request, UpdateWeightsFromTensorRequest)
            if err is not None:
                return err
            return await load_tensors(body, lambda: asyncio.to_thread(decode_named_tensors,
                                                                      body.serialized_named_tensors[0]))
        async with body_buffer.lock:
            try:
                blob = await read_body(request, body_buffer)  # read whole also when refused: the client sends it
                fields = TensorUpdateFields.model_validate(dict(request.query_params))
            except ValueError as failure:  # a pydantic ValidationError too
                return result(False, f"update_weights_from_tensor: {failure}")

            async def tensors_in_body() -> dict:
                return parse_safetensors(blob)

            answer = await load_tensors(fields, tensors_in_body)
            if not server.weight_session_open:  # refused outside a session: no bucket follows to reuse the buffer
                body_buffer.drop()
            return answer

    async def load_tensors(body: TensorUpdateFields, read_tensors) -> JSONResponse:
        """The route's checks and load, as SGLang orders them; read_tensors() -> awaitable {name: tensor}."""
        if not server.weight_session_open:
            return no_session("update_weights_from_tensor")
        if body.selector == "draft":
            return result(False, "selector 'draft': this engine has no draft model; send 'all' or 'target'")
        if body.abort_all_requests:
            batcher.abort(abort_all=True)
        try:
            tensors = await read_tensors()
            await asyncio.wrap_future(server.apply_weights_future(tensors, body.weight_version))
        except Exception as failure:  # not our encoding, unknown names, wrong shapes, released weights
            server.weight_update_events.append("update_weights_from_tensor failed")
            return result(False, f"Failed to update weights from tensor: {failure}")
        del tensors
        server.weight_update_events.append("update_weights_from_tensor")
        if body.flush_cache and await holds_kv_cache():
            return kv_cache_kept("update_weights_from_tensor")
        return result(True, "Succeeded to update model weights.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body, err = await parse(request, UpdateWeightsFromDistributedRequest)
        if err is not None:
            return err
        if not server.weight_session_open:
            return no_session("update_weights_from_distributed")
        if body.abort_all_requests:
            batcher.abort(abort_all=True)
        try:
            tensors = await asyncio.to_thread(server.receive_weights, body)
            await asyncio.wrap_future(server.apply_weights_future(tensors, body.weight_version))
        except Exception as failure:
            server.weight_update_events.append("update_weights_from_distributed failed")
            return result(False, f"Failed to update parameter online: {failure}")
        del tensors  # the bucket's buffers: only the loaded copies stay
        server.weight_update_events.append("update_weights_from_distributed")
        if body.flush_cache and await holds_kv_cache():
            return kv_cache_kept("update_weights_from_distributed")
        return result(True, "Succeeded to update parameter online.")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body, err = await parse(request, GetWeightsByNameRequest)
        if err is not None:
            return err
        try:
            values = await asyncio.wrap_future(batcher.call(lambda: server.weights_by_name(body.name,
                                                                                        body.truncate_size)))
        except ValueError as failure:
            return JSONResponse({"error": {"message": f"Get parameter by name failed: {failure}"}}, status_code=400)
        return Response(orjson.dumps(values), media_type="application/json")
