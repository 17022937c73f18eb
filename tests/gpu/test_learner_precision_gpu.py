"""Issue 28 item 2 on CUDA: spillover's LearnerActor on Qwen2.5-0.5B's shape (random init, built in code) with the
0.5B recipe's precision (FSDP2, bfloat16 compute, float32 masters and AdamW state, lr 1e-6): the first update moves
the weights, and engines are sent bfloat16. The CPU counterpart is tests/integration/test_learner_precision.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_recipe_learner_steps_at_lr_1e6_on_float32_masters_with_bf16_compute():
    from spillover.bench.gpu_learner import learner_smoke

    out = learner_smoke("0.5b", "cuda", iterations=2, samples=32, tokens=256)
    assert out["params"] > 4e8 and out["lr"] == 1e-6
    assert out["model_dtype"] == out["param_dtype"] == "bfloat16"
    assert out["master_dtypes"] == out["optimizer_state_dtypes"] == ["float32"]
    assert out["compute_dtypes"] == ["bfloat16"] and out["sent_dtypes"] == ["bfloat16"]
    assert out["moved_share"] > 0.9, out  # as bfloat16 masters, a 1e-6 step would round away almost everywhere
