"""Session fixtures for the engine layer: the real sglang-router on 127.0.0.1 with two torch engine
servers (tiny model) registered behind it, and a 'varied' copy of the tiny model.

The randomly initialised tiny model repeats its last token under greedy decoding, which makes
equality tests weak; `varied_model_dir` redraws its layer weights (seeded) so greedy outputs vary,
hit EOS, and differ from the tiny model's (a real weight update changes outputs).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def build_varied_model(src: Path, dst: Path, std: float = 0.3, seed: int = 1) -> Path:
    """Copy the HF folder src to dst with every 2-D layer weight redrawn from N(0, std)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if ".layers." in name and t.dim() == 2:
                tensors[name] = torch.randn(t.shape, generator=gen) * std
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def varied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_varied_model(Path(tiny_model_dir), tmp_path_factory.mktemp("varied_model"))


@pytest.fixture(scope="session")
def torch_engines(tiny_model_dir):
    """Two torch engine servers (in this process, background threads) on free 127.0.0.1 ports."""
    from spillover.rollout.sglang.backend import ENGINE_ENV  # the fleet's engines' environment
    from spillover.rollout.torch_engine.server import TorchEngineServer

    servers = []
    try:
        for i in range(2):
            server = TorchEngineServer(str(tiny_model_dir), port=0, max_running_requests=32, seed=i, env=ENGINE_ENV)
            server.start()
            servers.append(server)
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def sglang_router(torch_engines):
    """The real sglang-router (round robin) with both torch engines registered."""
    from spillover.rollout.fleet.router import Router

    router = Router.launch(host="127.0.0.1")
    try:
        for server in torch_engines:
            router.add_worker(server.url)
        yield router
    finally:
        router.stop()
