"""The SGLang backend for real: RolloutManager with backend "sglang" on a GPU machine.

Needs CUDA, Ray and `pip install spillover[sglang]`; skipped otherwise (a failure with SPILLOVER_REQUIRE_GPU=1). The
model is tests/gpu/conftest.py's random-init Qwen2.5-0.5B shape (built in code; SPILLOVER_GPU_MODEL, a local HF
folder, replaces it). One engine, one GPU, real sglang-router.
"""
from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")  # before the fixtures: tests/conftest.py's ray_session needs it
pytest.importorskip("sglang")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = {"max_new_tokens": 16, "temperature": 0}
PROMPTS = [[785, 6722, 315, 9625, 374], [16, 488, 220, 16, 284], [9707, 11, 847, 829, 374]]


@pytest.fixture(scope="module")
def model_path(recipe_model_dir) -> str:
    return os.environ.get("SPILLOVER_GPU_MODEL") or str(recipe_model_dir)


@pytest.fixture(scope="module")
def sglang_manager(ray_session, model_path):
    from spillover.infra.config.engines import EnginesConfig
    from spillover.rollout.fleet.manager import RolloutManager

    cfg = EnginesConfig(backend="sglang", rollout_num_gpus=1, gpus_per_engine=1, max_running_requests=64,
                        health_timeout_s=60)
    manager = RolloutManager(cfg, model_path,
                             sglang_options={"mem_fraction_static": 0.5})
    yield manager
    manager.shutdown()


def batch(params, prompts=PROMPTS):
    from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest

    return [GenerateJob(GenerateRequest(input_ids=p, sampling_params=params, return_logprob=True)) for p in prompts]


def test_generate_through_router(sglang_manager):
    results = sglang_manager.generate(batch(GREEDY))
    for prompt, res in zip(PROMPTS, results):
        meta = res.meta_info
        assert meta.prompt_tokens == len(prompt)
        assert meta.completion_tokens == len(res.output_ids) == len(meta.output_token_logprobs)


def test_update_weights_from_tensor_changes_outputs_and_version(sglang_manager, model_path):
    from safetensors.torch import load_file

    from spillover.rollout.fleet.weights.weight_update import WeightUpdate

    path = model_path
    before = sglang_manager.generate(batch(GREEDY))
    state = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, f)))
    noisy = {k: (v + 0.05 * torch.randn_like(v.float()).to(v.dtype)) if v.dim() == 2 else v for k, v in state.items()}
    assert sglang_manager.update_weights(WeightUpdate("tensor", noisy, 3)) == {0: 3}
    after = sglang_manager.generate(batch(GREEDY))
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert sglang_manager.update_weights(WeightUpdate("disk", path, 4)) == {0: 4}  # back from disk
    assert [r.output_ids for r in sglang_manager.generate(batch(GREEDY))] == [r.output_ids for r in before]


def test_abort_all_then_offload_resume_and_load(sglang_manager, model_path):
    import threading

    from fleet_probes import resume_memory
    from spillover.rollout.fleet.weights.weight_update import WeightUpdate

    box = {}
    thread = threading.Thread(target=lambda: box.update(r=sglang_manager.generate(
        batch({"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}, PROMPTS * 8))))
    thread.start()
    time.sleep(2.0)
    sglang_manager.abort_all()
    thread.join(60)
    assert {r.meta_info.finish_reason.type for r in box["r"]} == {"abort"}
    sglang_manager.offload()
    resume_memory(sglang_manager)  # as a colocated update does: the weights come back empty, the load follows
    assert sglang_manager.update_weights(WeightUpdate("disk", model_path, 5)) == {0: 5}
    assert len(sglang_manager.generate(batch(GREEDY))) == len(PROMPTS)
