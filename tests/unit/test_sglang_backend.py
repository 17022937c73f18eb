"""The SGLang backend's launch command and request bodies (SGLang itself cannot run here: no GPU).

Flag and field names are SGLang 0.5.x's (`server_args.py`, `managers/io_struct.py`, `http_server.py`).
"""
from __future__ import annotations

import sys
import time

import psutil
import pytest

from spillover.rollout.fleet.engine_pool import bundle_order, engine_layout
from spillover.rollout.sglang import backend as sgl
from spillover.rollout.sglang.protocol import (BeginWeightUpdateRequest, EndWeightUpdateRequest,
                                               InitWeightsUpdateGroupRequest, ReleaseMemoryOccupationRequest,
                                               ResumeMemoryOccupationRequest, UpdateWeightsFromDistributedRequest,
                                               UpdateWeightsFromTensorRequest)
from spillover.rollout.fleet.engine_actor import free_ports
from waiting import wait_for


def flags(cmd: list[str]) -> dict[str, str | bool]:
    """`--name value` pairs of an argv (bare flags map to True)."""
    out: dict[str, str | bool] = {}
    i = cmd.index("sglang.launch_server") + 1
    while i < len(cmd):
        name = cmd[i]
        if i + 1 < len(cmd) and not cmd[i + 1].startswith("--"):
            out[name], i = cmd[i + 1], i + 2
        else:
            out[name], i = True, i + 1
    return out


def test_single_node_command():
    spec = sgl.SGLangLaunch(model_path="/ckpt", host="127.0.0.1", port=30001, nccl_port=30002, tp_size=2,
                            base_gpu_id=4, max_running_requests=64, random_seed=3, weight_version=5)
    cmd = sgl.launch_command(spec, python="/py")
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    f = flags(cmd)
    assert f == {"--model-path": "/ckpt", "--host": "127.0.0.1", "--port": "30001", "--tp-size": "2",
                 "--nccl-port": "30002", "--base-gpu-id": "4", "--random-seed": "3", "--weight-version": "5",
                 "--log-level": "warning", "--max-running-requests": "64", "--enable-memory-saver": True}


def test_multi_node_command_names_node_zero():
    spec = sgl.SGLangLaunch(model_path="/ckpt", host="10.0.0.2", port=1, nccl_port=2, tp_size=16, nnodes=2,
                            node_rank=1, dist_init_addr="10.0.0.1:5000", enable_memory_saver=False,
                            mem_fraction_static=0.7, extra_args=("--trust-remote-code",))
    f = flags(sgl.launch_command(spec))
    assert (f["--nnodes"], f["--node-rank"], f["--dist-init-addr"]) == ("2", "1", "10.0.0.1:5000")
    assert f["--mem-fraction-static"] == "0.7" and f["--trust-remote-code"] is True
    assert "--enable-memory-saver" not in f


@pytest.mark.parametrize("kwargs, match", [
    ({"nnodes": 2}, "dist_init_addr"),
    ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "a:1", "tp_size": 2}, "node_rank"),
    ({"nnodes": 2, "dist_init_addr": "a:1", "tp_size": 3}, "multiple of nnodes"),
])
def test_bad_launch_specs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sgl.SGLangLaunch(model_path="/m", host="h", port=1, nccl_port=2, **kwargs)


def test_weight_and_memory_bodies_use_sglang_field_names():
    assert ReleaseMemoryOccupationRequest().model_dump() == {"tags": None}
    assert ResumeMemoryOccupationRequest(tags=["weights"]).model_dump() == {"tags": ["weights"]}
    with pytest.raises(ValueError, match="kv_cache"):
        ReleaseMemoryOccupationRequest(tags=["kv"])
    assert UpdateWeightsFromTensorRequest(serialized_named_tensors=["a", "b"], weight_version=3).model_dump() == {
        "serialized_named_tensors": ["a", "b"], "load_format": None, "flush_cache": True,
        "abort_all_requests": False, "weight_version": "3", "selector": "all"}
    with pytest.raises(ValueError, match="at least 1 item"):
        UpdateWeightsFromTensorRequest(serialized_named_tensors=[], weight_version=1)
    assert UpdateWeightsFromDistributedRequest(names=["w"], dtypes=["bfloat16"], shapes=[(2, 3)],
                                               weight_version=4).model_dump() == {
        "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "weight_update_group",
        "flush_cache": True, "abort_all_requests": False, "weight_version": "4", "load_format": None}
    with pytest.raises(ValueError, match="one entry per tensor"):
        UpdateWeightsFromDistributedRequest(names=["w", "v"], dtypes=["bfloat16"], shapes=[[1]], weight_version=4)
    assert InitWeightsUpdateGroupRequest(master_address="10.0.0.1", master_port=29500, rank_offset=1,
                                         world_size=3).model_dump() == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "weight_update_group", "backend": "nccl"}
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        InitWeightsUpdateGroupRequest(master_address="h", master_port=1, rank_offset=3, world_size=3)
    assert sgl.ENDPOINTS["update_from_tensor"] == "/update_weights_from_tensor"



def test_weight_update_session_bodies_and_tensor_encodings():
    """begin/end bodies are SGLang's (selector all|target|draft); a bucket before the last sends no weight_version;
    the torch engine's encoding round-trips the tensors (tied ones included) and one entry goes to each TP rank."""
    import torch
    from sglang_contract import check_payload

    from spillover.rollout.sglang.tensor_wire import decode_named_tensors

    assert BeginWeightUpdateRequest().model_dump() == {"selector": "all"}
    assert BeginWeightUpdateRequest(selector="draft").model_dump() == {"selector": "draft"}
    with pytest.raises(ValueError, match="selector"):
        BeginWeightUpdateRequest(selector="both")
    assert EndWeightUpdateRequest().model_dump() == {}
    check_payload(sgl.ENDPOINTS["begin_weight_update"], BeginWeightUpdateRequest().model_dump())
    check_payload(sgl.ENDPOINTS["end_weight_update"], EndWeightUpdateRequest().model_dump())
    assert UpdateWeightsFromTensorRequest(serialized_named_tensors=["a"], flush_cache=False).weight_version is None
    embed = torch.randn(5, 3)
    named = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed),
             ("w", torch.ones(2, dtype=torch.bfloat16))]
    entries = sgl.serialize_named_tensors(named, 2, backend="torch")
    assert len(entries) == 2 and all(isinstance(e, str) for e in entries)
    check_payload(sgl.ENDPOINTS["update_from_tensor"],
                  UpdateWeightsFromTensorRequest(serialized_named_tensors=entries, weight_version=3).model_dump())
    decoded = decode_named_tensors(entries[1])
    assert set(decoded) == {n for n, _ in named}
    assert all(torch.equal(decoded[n], t) and decoded[n].dtype == t.dtype for n, t in named)
    with pytest.raises(ValueError, match="backend"):
        sgl.serialize_named_tensors(named, 1, backend="vllm")
    with pytest.raises(ValueError, match="safetensors"):
        decode_named_tensors("not base64 at all!")

def test_process_stop_takes_the_whole_group(tmp_path, monkeypatch):
    """SGLangProcess.stop() signals the process group: a child the server spawned goes too."""
    script = tmp_path / "fake_server.py"
    pid_file = tmp_path / "child.pid"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(sgl, "launch_command", lambda spec, python=sys.executable: [python, str(script)])
    proc = sgl.SGLangProcess(sgl.SGLangLaunch(model_path="/m", host="127.0.0.1", port=1, nccl_port=2))
    child = int(wait_for(lambda: pid_file.read_text() if pid_file.exists() else "", 10,
                         "the fake server writing its child's pid", every=0.05))
    assert proc.alive()
    proc.stop(grace_s=5)
    assert not proc.alive()

    def child_gone() -> bool:  # signalled with the group; on a busy machine it may take a moment to exit
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(child_gone, 10, "the server's child gone with its group", every=0.05, until=bool)


def test_free_ports_are_distinct_and_skip_excluded():
    first = free_ports("127.0.0.1", 3)
    assert len(set(first)) == 3
    again = free_ports("127.0.0.1", 3, exclude=set(first))
    assert not set(again) & set(first)


def test_bundle_order_groups_by_node_then_gpu():
    locations = [("n1", [3]), ("n0", [1]), ("n1", [0]), ("n0", [0])]
    assert bundle_order(locations) == [2, 0, 3, 1]
    assert bundle_order([("a", []), ("b", []), ("a", [])]) == [0, 2, 1]


def test_engine_layout_puts_node_actors_on_their_slots():
    assert engine_layout(4, 1, 8) == [[0], [1], [2], [3]]
    assert engine_layout(8, 4, 8) == [[0], [4]]
    assert engine_layout(4, 4, 2) == [[0, 2]]  # one engine over two nodes: node-0 actor at 0, node-1 at 2
    assert engine_layout(8, 4, 2) == [[0, 2], [4, 6]]
    with pytest.raises(ValueError, match="multiple"):
        engine_layout(6, 3, 2)
