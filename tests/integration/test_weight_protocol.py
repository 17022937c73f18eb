"""The torch engine speaks SGLang's distributed weight protocol over real HTTP and a real gloo group: a stand-in
trainer process (tests/weight_sender.py) broadcasts another model's tensors in buckets and the engine's weights
then equal them bit for bit (/get_weights_by_name). Bodies are SGLang's (rollout/sglang/protocol.py's models),
checked against SGLang 0.5.23's recorded request fields (tests/sglang_contract.py), not against copies of themselves."""
from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from spillover.rollout.fleet.weights.fleet_weights import bucket_payloads
from spillover.rollout.sglang import backend as sgl
from spillover.rollout.sglang.protocol import (BeginWeightUpdateRequest, EndWeightUpdateRequest,
                                               InitWeightsUpdateGroupRequest, TensorUpdateFields,
                                               UpdateWeightsFromDistributedRequest, UpdateWeightsFromTensorRequest)
from spillover.rollout.sglang.tensor_wire import SAFETENSORS_MEDIA_TYPE, safetensors_chunks
from spillover.rollout.sglang.update_group import dtype_name, plan_buckets
from sglang_contract import check_payload, field_default, route

SENDER = Path(__file__).resolve().parents[1] / "weight_sender.py"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from spillover.rollout.torch_engine.server import TorchEngineServer

    server = TorchEngineServer(str(tiny_model_dir), port=0, max_running_requests=4)
    server.update_group_timeout_s = 60.0
    server.start()
    yield server
    server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(engine, path: str, payload: dict, timeout: float = 60.0) -> httpx.Response:
    check_payload(path, payload)
    return httpx.post(engine.url + path, json=payload, timeout=timeout)


def weights_by_name(engine, name: str, rows: int) -> torch.Tensor:
    payload = {"name": name, "truncate_size": rows}
    check_payload("/get_weights_by_name", payload)
    response = httpx.post(engine.url + "/get_weights_by_name", json=payload, timeout=30)
    assert response.status_code == 200, response.text
    return torch.tensor(response.json(), dtype=torch.float32)


def join(port: int, group: str, backend: str) -> dict:
    return InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                                         group_name=group, backend=backend).model_dump()


def test_request_models_match_sglangs_request_fields():
    """Every key our request models send is a field of SGLang's request type; defaults we rely on are SGLang's."""
    check_payload("/init_weights_update_group", join(1, "g", "gloo"))
    check_payload("/update_weights_from_distributed", UpdateWeightsFromDistributedRequest(
        names=["w"], dtypes=["bfloat16"], shapes=[[2]], weight_version=3, group_name="g").model_dump())
    check_payload("/destroy_weights_update_group", {"group_name": "g"})
    check_payload("/begin_weight_update", BeginWeightUpdateRequest().model_dump())
    check_payload("/end_weight_update", EndWeightUpdateRequest().model_dump())
    assert field_default("/init_weights_update_group", "group_name") == "weight_update_group"
    assert field_default("/update_weights_from_distributed", "flush_cache") is True
    assert route("/update_weights_from_distributed")["needs_weight_update_session"] is True


def test_distributed_update_in_buckets_is_bit_identical(engine, varied_model_dir):
    """Bucket smaller than the largest tensor (it goes alone); the version set by the last bucket, the only one that
    carries it (as SGLang, a bucket without one leaves the engine's version); the group destroyed after."""
    file = next(Path(varied_model_dir).glob("*.safetensors"))
    target = load_file(str(file))
    names = [n for n in engine.batcher.decoder.expected_names()]
    specs = [(n, dtype_name(target[n].dtype), list(target[n].shape)) for n in names]
    largest = max(target[n].numel() * target[n].element_size() for n in names)
    buckets = plan_buckets(specs, largest // 2)
    assert len(buckets) > 2 and any(len(b) == 1 for b in buckets)
    before = weights_by_name(engine, "model.layers.0.mlp.up_proj.weight", 10**6)
    for version, group in ((5, "g-a"),):
        port = free_port()
        sender = subprocess.Popen([sys.executable, str(SENDER), "127.0.0.1", str(port), "2", group, str(file),
                                   json.dumps([[n for n, _, _ in b] for b in buckets])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            r = post(engine, "/init_weights_update_group", join(port, group, "gloo"))
            assert r.status_code == 200 and r.json()["success"], r.text
            assert post(engine, "/begin_weight_update", {"selector": "all"}).json()["success"]
            for payload in bucket_payloads(buckets, version, group, flush_cache=True):  # the version on the last
                r = post(engine, "/update_weights_from_distributed", payload)
                assert r.status_code == 200 and r.json()["success"], r.text
                reported = httpx.get(engine.url + "/model_info").json()["weight_version"]
                assert (reported == str(version)) == (payload["weight_version"] is not None), reported
            assert post(engine, "/end_weight_update", {}).json()["success"]
            assert sender.wait(timeout=60) == 0, sender.stderr.read()
        finally:
            sender.kill()
        assert post(engine, "/destroy_weights_update_group", {"group_name": group}).json()["success"]
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] == str(version)
    for name in names:
        got = weights_by_name(engine, name, 10**6)
        assert torch.equal(got, target[name].float()), name
    assert not torch.equal(before, target["model.layers.0.mlp.up_proj.weight"])


def test_refusals_name_the_fix(engine):
    """No session, an unknown group, NCCL on a CPU engine, a doubled session, an unknown weight name."""
    payload = UpdateWeightsFromDistributedRequest(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]],
                                                  weight_version=9, group_name="nope").model_dump()
    r = post(engine, "/update_weights_from_distributed", payload)
    assert r.status_code == 400 and not r.json()["success"] and "begin_weight_update" in r.json()["message"]
    assert post(engine, "/begin_weight_update", {"selector": "all"}).json()["success"]
    r = post(engine, "/begin_weight_update", {"selector": "all"})
    assert r.status_code == 400 and "already open" in r.json()["message"]
    r = post(engine, "/update_weights_from_distributed", payload)
    assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    assert post(engine, "/end_weight_update", {}).json()["success"]
    assert post(engine, "/end_weight_update", {}).status_code == 400
    r = post(engine, "/init_weights_update_group", join(1, "x", "nccl"))
    assert r.status_code == 400 and "gloo" in r.json()["message"]
    r = httpx.post(engine.url + "/get_weights_by_name", json={"name": "model.nope"}, timeout=30)
    assert r.status_code == 400 and "model.nope" in r.json()["error"]["message"]
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] != "9"


def test_get_weights_by_name_truncates_rows_like_sglang(engine):
    full = weights_by_name(engine, "model.embed_tokens.weight", 10**6)
    assert weights_by_name(engine, "model.embed_tokens.weight", 3).shape == (3, full.shape[1])
    assert torch.equal(weights_by_name(engine, "lm_head.weight", 10**6), full) == engine.shape.tie_word_embeddings


def tensor_payload(tensors: dict, version, *, flush_cache: bool = True) -> dict:
    """The client's own body (the backend's serializer with the torch engine's encoding), checked against SGLang's
    recorded request fields."""
    payload = UpdateWeightsFromTensorRequest(
        serialized_named_tensors=sgl.serialize_named_tensors(list(tensors.items()), 1, backend="torch"),
        weight_version=version, flush_cache=flush_cache).model_dump()
    check_payload("/update_weights_from_tensor", payload)
    return payload


def test_tensor_update_is_refused_outside_a_session_like_sglang(engine, varied_model_dir):
    """SGLang 0.5.23 answers success:false (HTTP 400) to tensor and distributed updates outside
    /begin_weight_update ... /end_weight_update; from disk needs no session."""
    assert route("/update_weights_from_tensor")["needs_weight_update_session"] is True
    assert route("/update_weights_from_disk")["needs_weight_update_session"] is False
    norm = load_file(str(next(Path(varied_model_dir).glob("*.safetensors"))))["model.norm.weight"]
    before = weights_by_name(engine, "model.norm.weight", 10**6)
    r = post(engine, "/update_weights_from_tensor", tensor_payload({"model.norm.weight": norm}, 11))
    assert r.status_code == 400 and r.json()["success"] is False and "begin_weight_update" in r.json()["message"]
    assert torch.equal(weights_by_name(engine, "model.norm.weight", 10**6), before)
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] != "11"
    r = post(engine, "/update_weights_from_disk", {"model_path": str(engine.model_path), "weight_version": "0"})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_tensor_update_in_a_session_in_buckets_sets_weights_and_version(engine, varied_model_dir, tiny_model_dir):
    """The route takes SGLang's request shape; buckets before the last leave the version; the weights then equal
    the sent ones bit for bit. An entry in SGLang's own encoding (a pickle) is refused, never unpickled."""
    import base64
    import pickle

    target = load_file(str(next(Path(varied_model_dir).glob("*.safetensors"))))
    names = list(engine.batcher.decoder.expected_names())
    half = len(names) // 2
    assert post(engine, "/begin_weight_update", BeginWeightUpdateRequest().model_dump()).json()["success"]
    try:
        first = post(engine, "/update_weights_from_tensor",
                     tensor_payload({n: target[n] for n in names[:half]}, None, flush_cache=False))
        assert first.status_code == 200 and first.json()["success"], first.text
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] not in (12, "12")
        pickled = base64.b64encode(pickle.dumps([("model.norm.weight", target["model.norm.weight"])])).decode()
        r = post(engine, "/update_weights_from_tensor",
                 UpdateWeightsFromTensorRequest(serialized_named_tensors=[pickled], weight_version=12).model_dump())
        assert r.status_code == 400 and not r.json()["success"] and "safetensors" in r.json()["message"]
        last = post(engine, "/update_weights_from_tensor", tensor_payload({n: target[n] for n in names[half:]}, 12))
        assert last.status_code == 200 and last.json()["success"], last.text
    finally:
        assert post(engine, "/end_weight_update", EndWeightUpdateRequest().model_dump()).json()["success"]
    assert_holds_then_reset(engine, {n: target[n] for n in names}, 12, tiny_model_dir)


def assert_holds_then_reset(engine, tensors: dict, version: int, checkpoint_dir) -> None:
    """The engine reports `version` and holds `tensors` bit for bit; then it goes back to the checkpoint (version 0)
    for the module's next test."""
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] == str(version)
    for name, tensor in tensors.items():
        assert torch.equal(weights_by_name(engine, name, 10**6), tensor.float()), name
    reset = post(engine, "/update_weights_from_disk", {"model_path": str(checkpoint_dir), "weight_version": "0"})
    assert reset.json()["success"], reset.text


def binary_post(engine, tensors: dict, version, *, flush_cache: bool = True, blob: bytes | None = None,
                query: dict | None = None) -> httpx.Response:
    """The torch engine's binary /update_weights_from_tensor as WeightPoster sends it: a safetensors body, SGLang's
    other fields in the query (or the blob and query given, to send a wrong one)."""
    named = list(tensors.items())
    body = blob if blob is not None else b"".join(safetensors_chunks(named))
    return httpx.post(engine.url + "/update_weights_from_tensor", content=body, timeout=60,
                      params=query if query is not None else TensorUpdateFields(weight_version=version,
                                                                                flush_cache=flush_cache).query(),
                      headers={"Content-Type": SAFETENSORS_MEDIA_TYPE})


def test_tensor_update_as_a_binary_body_sets_weights_and_version_on_the_last_bucket(engine, varied_model_dir,
                                                                                   tiny_model_dir):
    """The binary body (what WeightPoster sends the torch engine: no base64 inside JSON) loads bit for bit; a bucket
    without weight_version leaves the engine's version, the last sets it; a blob that is not safetensors, a body
    cut short and a field SGLang would refuse are answered success:false naming the fault, outside a session too."""
    target = load_file(str(next(Path(varied_model_dir).glob("*.safetensors"))))
    names = list(engine.batcher.decoder.expected_names())
    half = len(names) // 2
    assert "session" in binary_post(engine, {names[0]: target[names[0]]}, 13).json()["message"]
    assert post(engine, "/begin_weight_update", BeginWeightUpdateRequest().model_dump()).json()["success"]
    try:
        first = binary_post(engine, {n: target[n] for n in names[:half]}, None, flush_cache=False)
        assert first.status_code == 200 and first.json()["success"], first.text
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] not in (13, "13")
        for wrong, match in ((dict(blob=pickle.dumps([("model.norm.weight", target["model.norm.weight"])])),
                              "safetensors"),
                             (dict(query={"load_format": "auto"}), "load_format"),
                             (dict(blob=b"\x10\x00\x00\x00\x00\x00\x00\x00{}"), "header length")):
            r = binary_post(engine, {"model.norm.weight": target["model.norm.weight"]}, 13, **wrong)
            assert r.status_code == 400 and not r.json()["success"] and match in r.json()["message"], r.text
        last = binary_post(engine, {n: target[n] for n in names[half:]}, 13)
        assert last.status_code == 200 and last.json()["success"], last.text
    finally:
        assert post(engine, "/end_weight_update", EndWeightUpdateRequest().model_dump()).json()["success"]
    assert_holds_then_reset(engine, {n: target[n] for n in names}, 13, tiny_model_dir)


def test_weight_poster_updates_the_torch_engine_in_binary_buckets(engine, varied_model_dir, tiny_model_dir):
    """WeightPoster.update, the engine actors' and colocated ranks' client: every bucket a binary body, one session,
    the version reported at the end, the weights bit for bit."""
    from spillover.rollout.fleet.weights.weight_poster import WeightPoster

    target = load_file(str(next(Path(varied_model_dir).glob("*.safetensors"))))
    state = {n: target[n] for n in engine.batcher.decoder.expected_names()}
    smallest = min(t.numel() * t.element_size() for t in state.values())
    engine.weight_update_events.clear()
    assert WeightPoster(engine.url, "torch").update(state, 14, bucket_bytes=4 * smallest) == 14
    events = list(engine.weight_update_events)
    assert events[0] == "begin_weight_update" and events[-1] == "end_weight_update"
    assert events[1:-1] == ["update_weights_from_tensor"] * (len(events) - 2) and len(events) > 4, events
    assert_holds_then_reset(engine, state, 14, tiny_model_dir)
