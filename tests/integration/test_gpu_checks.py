"""tests/gpu on a machine like the lent GPU machine (no Ray, Prefect or SGLang; here also no CUDA), run as its
conftest says (`--confcutdir=tests/gpu`, since tests/conftest.py needs Ray): every check skips, and with
SPILLOVER_REQUIRE_GPU=1 every skip is a failure, so a GPU run cannot pass by skipping. A real pytest process."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LENT_MACHINE = """
import sys
class Missing:  # what the lent GPU machine lacks
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "prefect", "wandb", "s3fs", "sglang_router", "sglang"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""
GPU_TESTS = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))


def run_gpu_tests(require: str | None) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "SPILLOVER_REQUIRE_GPU"}
    env.update({"CUDA_VISIBLE_DEVICES": ""} if require is None else {"CUDA_VISIBLE_DEVICES": "",
                                                                      "SPILLOVER_REQUIRE_GPU": require})
    proc = subprocess.run([sys.executable, "-c", LENT_MACHINE, "--confcutdir=tests/gpu", "-p", "no:cacheprovider",
                           "-q", "-rA", "tests/gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    summary = proc.stdout.split("short test summary info", 1)[-1].splitlines()
    return proc.returncode, [line for line in summary if line.startswith(("SKIPPED", "ERROR", "FAILED", "PASSED"))]


def test_gpu_checks_skip_without_cuda_and_fail_when_a_gpu_is_required():
    code, lines = run_gpu_tests(None)
    assert code == 0 and lines and all(line.startswith("SKIPPED") for line in lines), lines
    assert len(lines) == len(GPU_TESTS)  # test_sglang_gpu.py skips as a module (no Ray, no SGLang)

    code, lines = run_gpu_tests("1")
    assert code == 1 and not any(line.startswith(("SKIPPED", "PASSED")) for line in lines), lines
    for name in GPU_TESTS:  # each module's checks, the module-level skip too, count as failures
        assert any(f"tests/gpu/{name}" in line for line in lines), (name, lines)
    assert any("test_sglang_gpu.py - SPILLOVER_REQUIRE_GPU=1" in line for line in lines), lines
