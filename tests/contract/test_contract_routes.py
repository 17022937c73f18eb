"""Every weight, memory, session and abort body the project sends, through SGLang 0.5.23's own request classes
(pydantic.TypeAdapter(io_struct.<class>).validate_python(body): what the route's FastAPI parse accepts), and no key
the project sends is one SGLang drops.

Bodies come from the project's request models (rollout/sglang/protocol.py) with the arguments their callers pass,
and from the callers themselves: DistributedWeights (rollout/fleet/weights/fleet_weights.py) driven
through a whole sync with recording clients, EngineClient (abort, update from disk) with its transport
recorded; each weight kind's body also as it goes out under engines.pause_mode=in_place (flush_cache false). The project
sends no /open_session or /close_session."""
from __future__ import annotations

import asyncio
import base64
from urllib.parse import parse_qsl

import orjson
import pytest

from contract_checks import accepted
from spillover.rollout.sglang import backend as sgl
from spillover.rollout.sglang.protocol import (BeginWeightUpdateRequest, ContinueGenerationRequest,
                                               EndWeightUpdateRequest, PauseGenerationRequest,
                                               ReleaseMemoryOccupationRequest, ResumeMemoryOccupationRequest,
                                               UpdateWeightsFromDistributedRequest, UpdateWeightsFromTensorRequest)
from spillover.rollout.fleet.engine_client import EngineClient
from spillover.rollout.fleet.weights.fleet_weights import DistributedWeights
from spillover.rollout.sglang.tensor_wire import SAFETENSORS_MEDIA_TYPE, parse_safetensors

ROUTE_CLASS = {  # SGLang 0.5.23 http_server.py: route -> the io_struct class its handler takes as Body()
    "/abort_request": "AbortReq",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
}


def wire(body: dict) -> dict:
    """The body as the server decodes it (EngineClient sends orjson)."""
    return orjson.loads(orjson.dumps(body))


def check(sglang, path: str, body: dict) -> dict:
    answer = accepted(sglang.route(ROUTE_CLASS[path], wire(body)), f"{path} {body}")
    assert not answer["dropped"], f"SGLang's {path} ignores {answer['dropped']} the project sends"
    return answer


@pytest.mark.parametrize("tags", [None, ["kv_cache"], ["weights"], ["weights", "kv_cache", "cuda_graph"]])
def test_memory_bodies(sglang, tags):
    """RolloutManager.offload and the resume before a colocated weight update (rollout/fleet/manager.py)."""
    check(sglang, "/release_memory_occupation", ReleaseMemoryOccupationRequest(tags=tags).model_dump())
    check(sglang, "/resume_memory_occupation", ResumeMemoryOccupationRequest(tags=tags).model_dump())


@pytest.mark.parametrize("selector", ["all", "target", "draft"])
def test_weight_update_session_bodies(sglang, selector):
    answer = check(sglang, "/begin_weight_update", BeginWeightUpdateRequest(selector=selector).model_dump())
    assert answer["parsed"] is None or answer["parsed"]["selector"] == selector
    check(sglang, "/end_weight_update", EndWeightUpdateRequest().model_dump())


@pytest.mark.parametrize("version", [None, 0, 7, "7"])
@pytest.mark.parametrize("backend", ["torch"])
def test_update_from_tensor_bodies(sglang, version, backend):
    """WeightPoster.post_bucket (engine actors) and the colocated load (tasks/learner/engine_host.py): a bucket before the last
    carries no version and keeps the cache. The sglang backend's entries (CUDA IPC handles) need a GPU; their type
    (base64 text) is the torch backend's too."""
    import torch

    entries = sgl.serialize_named_tensors([("w", torch.ones(2, 3))], tp_size=2, backend=backend)
    answer = check(sglang, "/update_weights_from_tensor", UpdateWeightsFromTensorRequest(
        serialized_named_tensors=entries, weight_version=version, flush_cache=version is not None).model_dump())
    if answer["parsed"] is not None:
        assert answer["parsed"]["weight_version"] == (None if version is None else str(version))


@pytest.mark.parametrize("flush_cache", [True, False])
def test_update_from_disk_bodies(sglang, flush_cache):
    """DiskWeights.load; flush_cache=False under engines.pause_mode=in_place (requests keep their KV cache)."""
    bodies = recorded_client_bodies(lambda c: c.update_weights_from_disk("/models/step-3", weight_version=3,
                                                                         flush_cache=flush_cache))
    answer = check(sglang, "/update_weights_from_disk", bodies["/update_weights_from_disk"][0])
    assert answer["parsed"] is None or answer["parsed"]["flush_cache"] is flush_cache


def test_abort_bodies(sglang):
    """EngineClient.abort, as BatchGenerator.abort_all and the manager call it."""
    for call in (lambda c: c.abort(abort_all=True), lambda c: c.abort(rid="a3f09c")):
        for body in recorded_client_bodies(call)["/abort_request"]:
            check(sglang, "/abort_request", body)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_and_continue_bodies(sglang, mode):
    """RolloutManager.update_weights while detached requests run (rollout.overlap): engines.pause_mode's body."""
    answer = check(sglang, "/pause_generation", PauseGenerationRequest(mode=mode).model_dump())
    assert answer["parsed"] is None or answer["parsed"]["mode"] == mode
    check(sglang, "/continue_generation", ContinueGenerationRequest().model_dump())


def recorded_client_bodies(call) -> dict[str, list[dict]]:
    """path -> the JSON bodies an EngineClient call sends (its transport recorded: no server)."""
    sent: dict[str, list[dict]] = {}
    client = EngineClient("http://127.0.0.1:1")

    async def record(method, path, json=None, timeout=None):
        sent.setdefault(path, []).append(orjson.loads(orjson.dumps(json)))
        return 200, b'{"success": true, "message": ""}'

    client._request = record
    asyncio.run(call(client))
    return sent


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _done(self.fn(*args))


async def _done(value):
    return value


class FakePolicy:
    """The learner group's side of a distributed sync (its torch.distributed broadcast is tests/integration's)."""

    weight_specs = _Remote(lambda: [("embed.weight", "bfloat16", [8, 4]), ("lm_head.weight", "bfloat16", [8, 4]),
                                    ("norm.weight", "float32", [4])])
    weight_sync_address = _Remote(lambda: ("127.0.0.1", 29512))
    join_weight_group = _Remote(lambda *args: None)
    broadcast_weights = _Remote(lambda *args: {"sent_bytes": 0})
    leave_weight_group = _Remote(lambda *args: None)


class RecordingEngine:
    def __init__(self, sent: list):
        self.sent = sent

    async def post(self, path, json=None, timeout=None):
        self.sent.append((path, wire(json)))
        return None

    async def health(self, *args, **kwargs):
        return True


@pytest.mark.parametrize("flush_cache", [True, False])
def test_distributed_sync_bodies(sglang, flush_cache):
    """A whole DistributedWeights sync: group formed (init), one session of buckets, group left (destroy). Only the
    last bucket carries the version and the cache flush (SGLang sets the version a body carries once its tensors are
    loaded: on every bucket it would label half-loaded weights new); flush_cache=False (engines.pause_mode=in_place)
    reaches the last bucket too."""
    sent: list[tuple[str, dict]] = []
    sync = DistributedWeights(lambda url: RecordingEngine(sent), bucket_bytes=80, ranks_per_engine=2, backend="nccl")
    urls = ["http://e0", "http://e1"]

    async def run():
        await sync.sync(FakePolicy(), urls, version=5, flush_cache=flush_cache)
        await sync.leave()

    asyncio.run(run())
    paths = [path for path, _ in sent]
    assert {"/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
            "/end_weight_update", "/destroy_weights_update_group"} <= set(paths), paths
    assert paths.count("/update_weights_from_distributed") > len(urls), "expected several buckets"
    for url_index in range(len(urls)):  # RecordingEngine does not say which engine: each got every bucket in order
        buckets = [body for path, body in sent if path == "/update_weights_from_distributed"][url_index::len(urls)]
        assert [b.get("weight_version") for b in buckets] == [None] * (len(buckets) - 1) + ["5"], buckets
        assert [b["flush_cache"] for b in buckets] == [False] * (len(buckets) - 1) + [flush_cache], buckets
    for path, body in sent:
        check(sglang, path, body)


def test_a_wrong_weight_body_is_refused(sglang_classes):
    """The check bites: SGLang's class refuses an int weight_version (declared Optional[str]; this project's
    models send str), a memory tag list of the wrong type, and a distributed update without its names."""
    good = UpdateWeightsFromDistributedRequest(names=["w"], dtypes=["bfloat16"], shapes=[[2]],
                                               weight_version=3).model_dump()
    accepted(sglang_classes.route(ROUTE_CLASS["/update_weights_from_distributed"], good), "the good body")
    for path, body in (("/update_weights_from_distributed", {**good, "weight_version": 3}),
                       ("/update_weights_from_disk", {"model_path": "/m", "weight_version": 1}),
                       ("/release_memory_occupation", {"tags": "kv_cache,weights"}),
                       ("/update_weights_from_distributed", {k: v for k, v in good.items() if k != "names"})):
        refused = sglang_classes.route(ROUTE_CLASS[path], body)
        assert not refused["ok"], f"SGLang accepted {path} {body}"


BODILESS = {"/health_generate", "/model_info", "/flush_cache"}  # GET, or a query string only


def test_every_endpoint_the_backend_names_is_checked_here():
    """A route added to sglang_backend.ENDPOINTS with a body fails here until a test above sends its body through
    SGLang's class."""
    unchecked = sorted(set(sgl.ENDPOINTS.values()) - set(ROUTE_CLASS) - BODILESS)
    assert not unchecked, f"add contract checks for {unchecked} (and their io_struct class to ROUTE_CLASS)"


def json_value(text: str):
    """A query value as JSON would carry it (true/false as booleans; everything else text)."""
    return {"true": True, "false": False}.get(text, text)


class CaptureServer:
    """A loopback HTTP server in place of SGLang's front (SGLang cannot run here): keeps each POST's path and JSON
    body (the torch engine's binary /update_weights_from_tensor as the JSON body of SGLang's shape it stands for: its
    query fields, the blob as the one base64 entry), answers success, and /model_info with the last weight_version it
    was sent."""

    def __init__(self):
        import http.server
        import threading

        self.sent: list[tuple[str, dict]] = []
        self.binary: list[str] = []  # paths of the posts with a binary body
        self.version = "0"
        capture = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: dict) -> None:
                data = orjson.dumps(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path, _, query = self.path.partition("?")
                if self.headers.get("Content-Type") == SAFETENSORS_MEDIA_TYPE:
                    capture.binary.append(path)
                    body = {**{k: json_value(v) for k, v in parse_qsl(query)},
                            "serialized_named_tensors": [base64.b64encode(raw).decode()]}
                else:
                    body = orjson.loads(raw or b"{}")
                capture.sent.append((path, body))
                capture.version = body.get("weight_version") or capture.version
                self._answer({"success": True, "message": ""})

            def do_GET(self):
                self._answer({"model_path": "/captured", "weight_version": capture.version})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("flush_cache", [True, False])
def test_engine_actor_tensor_update_bodies(sglang, flush_cache):
    """EngineActor.update_weights (engines.weight_sync=tensor, the recipes' default; its WeightPoster serves the
    colocated ranks too) over real HTTP: the session's begin, one /update_weights_from_tensor per bucket (the version
    and the cache flush on the last only; no flush at all under engines.pause_mode=in_place), end. The torch engine's
    buckets go as binary safetensors bodies whose query fields, with the blob as the entry, are SGLang's body."""
    import torch

    from spillover.rollout.fleet.engine_actor import EngineActor

    server = CaptureServer()
    try:
        actor = EngineActor.__new__(EngineActor)  # the plain class without Ray: what update_weights and its
        actor.backend, actor.url, actor.tp_size, actor.node_rank = "torch", server.url, 1, 0  # WeightPoster read
        actor.engine_index, actor.base_gpu_id = 0, 0
        state = {f"layer{i}.weight": torch.full((4, 4), float(i)) for i in range(3)}
        assert actor.update_weights(state, 9, bucket_bytes=64, flush_cache=flush_cache) == 9
    finally:
        server.close()
    paths = [path for path, _ in server.sent]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update"], paths
    assert server.binary == ["/update_weights_from_tensor"] * 3  # the torch engine's tensors: no base64 in JSON
    for path, body in server.sent:
        check(sglang, path, body)
    assert [body.get("weight_version") for _, body in server.sent[1:4]] == [None, None, "9"]
    assert [body["flush_cache"] for _, body in server.sent[1:4]] == [False, False, flush_cache]
    received = {}
    for _, body in server.sent[1:4]:
        received.update(parse_safetensors(bytearray(base64.b64decode(body["serialized_named_tensors"][0]))))
    assert received.keys() == state.keys() and all(torch.equal(received[n], t) for n, t in state.items())
