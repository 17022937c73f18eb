"""The SGLang backend, kept thin: the `sglang.launch_server` command line, SGLang's route names, the tensor
serialization of update_weights_from_tensor, and the server process's start/health/stop. The request bodies are
rollout/sglang/protocol.py's models.

Checked against sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py` (routes) and `server_args.py`
(flags), 0.5.x. GPU only: nothing here imports sglang except `serialize_named_tensors`, so the command is unit-tested
on CPU.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Route names of SGLang's native HTTP server (http_server.py).
ENDPOINTS = {
    "health_generate": "/health_generate",
    "release_memory": "/release_memory_occupation",
    "resume_memory": "/resume_memory_occupation",
    "update_from_tensor": "/update_weights_from_tensor",
    "update_from_distributed": "/update_weights_from_distributed",
    "init_update_group": "/init_weights_update_group",
    "destroy_update_group": "/destroy_weights_update_group",
    "update_from_disk": "/update_weights_from_disk",
    "begin_weight_update": "/begin_weight_update",
    "end_weight_update": "/end_weight_update",
    "model_info": "/model_info",  # /get_model_info answers too, with a deprecation warning (0.5.23)
    "abort": "/abort_request",
    "flush_cache": "/flush_cache",
    "pause_generation": "/pause_generation",
    "continue_generation": "/continue_generation",
}
# The environment every engine we start runs with. SGLang's /health runs a 1-token generation by default: a paused
# engine parks it (no answer for 20 s, then 503) and a released one runs it on freed memory (the server dies). Our
# weight-group forming and the router probe /health while an update pauses engines or colocation releases them, so
# /health must say only "the server is up"; /health_generate stays the generation probe (the manager's health check,
# which never runs during a pause and skips released engines). slime starts its engines the same way.
ENGINE_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}

# A live engine answers these at once or within seconds (SGLang 0.5.23: pause_generation in abort mode re-aborts every
# second until the aborted requests have returned; begin/end_weight_update on an engine that is not paused wait for its
# running requests, as every weight update does; continue_generation waits for an update running while paused). No
# answer within CONTROL_TIMEOUT_S means a hung engine: the post fails naming the route instead of holding the flow.
CONTROL_ROUTES = ("pause_generation", "continue_generation", "begin_weight_update", "end_weight_update", "flush_cache")
CONTROL_TIMEOUT_S = 60.0
# Releasing or resuming an engine's memory (colocation) moves the weights between host and device: seconds at the
# recipes' sizes, minutes at most for a large model; past MEMORY_TIMEOUT_S the engine is taken for hung.
MEMORY_ROUTES = ("release_memory", "resume_memory")
MEMORY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SGLangLaunch:
    """What one node of one SGLang engine needs to start (flags of `sglang.srt.server_args.ServerArgs`)."""

    model_path: str
    host: str
    port: int
    nccl_port: int
    tp_size: int = 1
    base_gpu_id: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "ip:port" of node 0; required when nnodes > 1
    max_running_requests: int | None = None
    random_seed: int = 0
    weight_version: int | str = 0
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = True  # without it /release_memory_occupation frees nothing
    skip_server_warmup: bool = False
    log_level: str = "warning"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("SGLangLaunch.dist_init_addr ('ip:port' of node 0) is required when nnodes > 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"SGLangLaunch.node_rank must be in [0, nnodes={self.nnodes}); got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"SGLangLaunch.tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")


def launch_command(spec: SGLangLaunch, python: str = sys.executable) -> list[str]:
    """argv of `python -m sglang.launch_server` for one node of one engine."""
    cmd = [python, "-m", "sglang.launch_server",
           "--model-path", spec.model_path, "--host", spec.host, "--port", str(spec.port),
           "--tp-size", str(spec.tp_size), "--nccl-port", str(spec.nccl_port),
           "--base-gpu-id", str(spec.base_gpu_id), "--random-seed", str(spec.random_seed),
           "--weight-version", str(spec.weight_version), "--log-level", spec.log_level]
    if spec.nnodes > 1:
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                "--dist-init-addr", str(spec.dist_init_addr)]
    if spec.max_running_requests is not None:
        cmd += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    return cmd + list(spec.extra_args)


def serialize_named_tensors(named_tensors: list[tuple[str, Any]], tp_size: int, backend: str = "sglang") -> list[str]:
    """The serialized_named_tensors entries (base64 text), one per TP rank. backend "sglang": SGLang's own
    serializer (CUDA IPC handles: needs sglang, a GPU and a receiver on the same node; the caller keeps the tensors
    alive until the call returns). backend "torch": the torch engine's CPU stand-in, a safetensors blob of the
    tensors' data (rollout/sglang/tensor_wire.py), which it decodes without unpickling anything."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1; got {tp_size}")
    if backend == "torch":
        from .tensor_wire import encode_named_tensors

        entry = encode_named_tensors(named_tensors)
        return [entry] * tp_size
    if backend != "sglang":
        raise ValueError(f"serialize_named_tensors: backend must be 'sglang' or 'torch'; got {backend!r}")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # GPU UUIDs, not indices: the engine may see other CUDA_VISIBLE_DEVICES
    return [MultiprocessingSerializer.serialize(named_tensors, output_str=True) for _ in range(tp_size)]


# ---- the server process ----------------------------------------------------------------------------------
class SGLangProcess:
    """One `sglang.launch_server` process (its own session, so stop() takes its scheduler children too). It runs
    under spillover.infra.fate_share: if the process that started it (the engine actor) dies, even by SIGKILL, the server
    and its scheduler children go too."""

    def __init__(self, spec: SGLangLaunch, env: dict[str, str] | None = None):
        """env: added to this process's environment (ENGINE_ENV first, which env may override)."""
        from ...infra.fate_share import fate_shared

        self.spec = spec
        self.url = f"http://{spec.host}:{spec.port}"
        self.proc = subprocess.Popen(fate_shared(launch_command(spec), whole_group=True),
                                     env={**os.environ, **ENGINE_ENV, **(env or {})}, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Block until /health_generate answers 200 (node 0 only: other nodes serve no HTTP)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server for {self.url} exited with code {self.proc.returncode} "
                                   "during startup (see its log above)")
            try:
                if httpx.get(self.url + ENDPOINTS["health_generate"], timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"sglang server {self.url} did not pass /health_generate within {timeout_s} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group; after the leader exits (or grace_s), SIGKILL whatever is left in it."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
