"""The colocated torch engine on CUDA (bench/gpu_smoke.py): an HF learner and the engine on one GPU, three
iterations of release -> learner step -> resume -> bucketed in-place load, then the 0.5B learner part. Skipped
without CUDA; the CPU path runs
in tests/integration/test_colocate.py (and the same script as a dry run there)."""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_colocated_engine_frees_the_gpu_and_comes_back_with_the_learners_weights():
    from spillover.bench.gpu_smoke import main

    out = main(["--device", "cuda", "--bucket-mb", "1"])
    assert not out["errors"], out["errors"]
    assert out["weights_equal"] == [True, True, True] and out["released_to_zero"] and out["greedy_changed"]
    assert min(out["freed_gb"]) > 0  # the release gives CUDA memory back
    learner = out["learner"]  # issues 12, 28: Qwen2.5-0.5B's shape, the recipe's precision, three update steps
    assert learner["params"] > 4e8 and learner["param_dtype"] == "bfloat16" and learner["peak_gpu_gb"] > 0
    assert learner["master_dtypes"] == ["float32"] and learner["moved_share"] > 0.9
    assert set(out["rollout"]) == {"no_partial", "sync_split4"}  # max_split 1 vs 4, rollout_s of each
