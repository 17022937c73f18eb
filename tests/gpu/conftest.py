"""The GPU checks' own plugin: a random-init model of a recipe's shape built in code (no download, no environment
variable), and SPILLOVER_REQUIRE_GPU=1, which turns every skip under tests/gpu (no CUDA, a missing package) into a
failure, so a run on a lent GPU machine cannot pass by skipping.

On a machine without Ray or Prefect (the lent GPU machine) tests/conftest.py cannot be imported: run these alone,
    SPILLOVER_REQUIRE_GPU=1 python -m pytest --confcutdir=tests/gpu -p no:cacheprovider tests/gpu \\
        --ignore=tests/gpu/test_sglang_gpu.py
(SGLang cannot be installed there; its checks need a machine with `pip install spillover[sglang]` and Ray).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE_GPU = "SPILLOVER_REQUIRE_GPU"


def _required() -> bool:
    return os.environ.get(REQUIRE_GPU, "") not in ("", "0")


def _as_failure(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_GPU}=1: {what} was skipped ({reason}), which counts as a failure here"


def pytest_configure(config):
    if _required():  # a module whose import skipped is an error then: the other modules' checks still run
        config.option.continue_on_collection_errors = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _required() and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()  # a module-level skip (pytest.importorskip at import, allow_module_level)
    if _required() and report.skipped:
        _as_failure(report, collector.nodeid)


@pytest.fixture(scope="session")
def recipe_model_dir(tmp_path_factory) -> Path:
    """A random-init Qwen2 of configs/gpu/qwen2.5-0.5b-*.yaml's shape (Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads,
    2 KV heads, intermediate 4864, vocabulary 151936), bfloat16 like the real checkpoint, with a small tokenizer."""
    from spillover.bench.gpu_learner import random_qwen2

    import torch

    return random_qwen2("0.5b", tmp_path_factory.mktemp("qwen2.5-0.5b-shape"), torch.bfloat16, tokenizer=True)
