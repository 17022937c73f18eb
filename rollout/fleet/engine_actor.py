"""`EngineActor`: one node of one rollout engine, as a Ray actor.

backend "torch": the actor holds a `TorchEngineServer` in-process (HTTP from a background thread); weights arrive
as Ray objects, a tensor each, fetched a bucket at a time and posted to it over HTTP, as to SGLang
(/update_weights_from_tensor inside a weight-update session), without touching disk or (in the actor) CUDA. The
torch engine has no tensor parallelism: a multi-node torch engine serves from node 0 and its other nodes only hold
their slots.

backend "sglang": the actor launches `sglang.launch_server` as a child process on its node (node 0
serves HTTP; other nodes join node 0's torch.distributed group) and maps weight updates to SGLang's
endpoints. GPU only.

Ports are found on the actor's own node (the manager passes the ports already taken there), and the
actor reports its URL back; only node 0 of an engine has one.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

from ..sglang import backend as sgl
from .weights.weight_poster import WeightPoster

BACKENDS = ("torch", "sglang")

def free_ports(host: str, count: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct ports the OS reports free on `host`, none of them in `exclude`."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            held.append(sock)  # keep it bound so the next bind gets a different port
            port = sock.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


def fetched(state_dict: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) in order, an ObjectRef's tensor fetched from Ray's object store when its turn comes (on the host:
    the learner puts host tensors, so no CUDA context opens here)."""
    import ray

    for name, value in state_dict.items():
        yield name, ray.get(value) if isinstance(value, ray.ObjectRef) else value


class EngineActor:
    """One node (`node_rank` of `nnodes`) of rollout engine `engine_index`. Wrap with `ray.remote`."""

    def __init__(self, backend: str, model_path: str, engine_index: int, node_rank: int = 0, nnodes: int = 1,
                 tp_size: int = 1, max_running_requests: int = 128, seed: int = 0,
                 weight_version: int = 0, torch_threads: int | None = None,
                 max_model_len: int | None = None, sglang_options: dict[str, Any] | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"engines.backend must be one of {BACKENDS}; got {backend!r}")
        import ray

        self.backend, self.model_path, self.engine_index = backend, str(model_path), engine_index
        self.node_rank, self.nnodes, self.tp_size = node_rank, nnodes, tp_size
        self.max_running_requests, self.seed, self.weight_version = max_running_requests, seed, weight_version
        self.torch_threads, self.max_model_len = torch_threads, max_model_len
        self.sglang_options = dict(sglang_options or {})
        self.host = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.url: str | None = None
        self.base_gpu_id = 0
        # torch backend, node 0: the engine's TorchEngineServer, in this process (tests and benchmarks read its weights
        # and weight-update events inside this actor, through Ray's __ray_call__)
        self.server = None
        self._process: sgl.SGLangProcess | None = None

    # ---- placement --------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        return {"engine_index": self.engine_index, "node_rank": self.node_rank, "node_id": self.node_id,
                "host": self.host, "pid": os.getpid(), "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
                "url": self.url, "server_pgid": self._process.proc.pid if self._process else None}

    def free_ports(self, count: int, exclude: list[int] | None = None) -> list[int]:
        return free_ports(self.host, count, set(exclude or ()))

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, port: int = 0, nccl_port: int | None = None, dist_init_addr: str | None = None,
              base_gpu_id: int = 0, timeout_s: float = 600.0) -> str | None:
        """Start serving; returns node 0's URL once healthy (None on other nodes)."""
        if self.backend == "torch":
            if self.node_rank > 0:
                return None
            from ..torch_engine.server import TorchEngineServer

            self.server = TorchEngineServer(
                self.model_path, host=self.host, port=port, max_running_requests=self.max_running_requests,
                seed=self.seed, weight_version=self.weight_version, torch_threads=self.torch_threads,
                max_model_len=self.max_model_len, env=sgl.ENGINE_ENV)
            self.url = self.server.start(timeout_s=min(timeout_s, 120.0))
            return self.url
        self.base_gpu_id = base_gpu_id
        spec = sgl.SGLangLaunch(
            model_path=self.model_path, host=self.host, port=port, nccl_port=int(nccl_port or 0),
            tp_size=self.tp_size, base_gpu_id=base_gpu_id, nnodes=self.nnodes, node_rank=self.node_rank,
            dist_init_addr=dist_init_addr, max_running_requests=self.max_running_requests,
            random_seed=self.seed, weight_version=self.weight_version, **self.sglang_options)
        self._process = sgl.SGLangProcess(spec)
        if self.node_rank == 0:
            self._process.wait_healthy(timeout_s)
            self.url = self._process.url
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._process is not None:
            self._process.stop()
            self._process = None

    # ---- weights ------------------------------------------------------------------------------------
    def poster(self) -> WeightPoster:
        """The HTTP weight-update client of this engine's server (node 0 only)."""
        if self.url is None:
            raise RuntimeError(f"engine {self.engine_index} node {self.node_rank} serves no HTTP (not started, or not "
                               f"node 0)")
        return WeightPoster(self.url, self.backend, self.tp_size, self.base_gpu_id, f"engine {self.engine_index}")

    def update_weights(self, state_dict: dict[str, Any], weight_version: int,
                       bucket_bytes: int | None = None, flush_cache: bool = True) -> int | None:
        """Apply HF-named tensors by /update_weights_from_tensor, in buckets of about bucket_bytes (None: one), inside
        one weight-update session; returns the version the engine reports. state_dict: {name: ObjectRef of a tensor}
        (the tensor sync's form: each is fetched when its bucket is posted and dropped after, so this process never
        holds the model), or tensors (Ray resolved a whole state dict's ObjectRef: all of it is here already).
        flush_cache=False while requests paused in_place hold their KV cache."""
        if self.node_rank > 0:
            return None
        return self.poster().update(fetched(state_dict), weight_version, bucket_bytes, flush_cache)

    def memory_bytes(self) -> dict[str, int]:
        """Torch backend: bytes of the weights and of the KV cache (0 while released)."""
        return self.server.memory_bytes()

