"""The torch engine server: an HF causal LM behind SGLang's native HTTP API (see protocol.py).

`TorchEngineServer(model_path).start()` loads the weights into a lean decoder, starts the continuous
batcher thread and serves HTTP (uvicorn) from a background thread of this process, so a Ray actor can
hold it and still call `load_weights` in-process. `python -m spillover.rollout.torch_engine.server` runs the
same server as a process (SIGTERM/SIGINT stop it).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import os
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import httpx
import torch
import uvicorn

from ...infra.tensor_memory import TensorMemoryProbe
from .batcher import ContinuousBatcher, EngineRequest
from .http_app import build_app
from .lean_forward import LeanDecoder, read_safetensors, read_shape
from ..sglang.protocol import (BadRequest, GenerateRequest, InitWeightsUpdateGroupRequest,
                               UpdateWeightsFromDistributedRequest, new_rid, parse_version)
from ..sglang.update_group import destroy_group, init_group, receive_bucket

FALSE_WORDS = ("false", "0", "no", "n")  # what SGLang's boolean variables read as false (srt/environ.py)
log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_dtype(model_path: str | Path, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on accelerators; float32 on CPU (half precision is slow there)."""
    if device.type == "cpu":
        return torch.float32
    config = json.loads((Path(model_path) / "config.json").read_text())
    return DTYPES.get(config.get("dtype") or config.get("torch_dtype") or "float32", torch.float32)


def check_kv_cache_size(shape, slots: int, max_len: int, dtype: torch.dtype, limit_gb: float) -> None:
    """The fixed-slot cache holds slots x max_len positions up front; refuse a size over limit_gb."""
    size_gb = (2 * shape.num_layers * slots * max_len * shape.num_kv_heads * shape.head_dim
               * torch.finfo(dtype).bits / 8) / 2**30
    if size_gb > limit_gb:
        raise ValueError(f"torch engine: the KV cache would take {size_gb:.1f} GiB ({slots} slots x {max_len} "
                         f"positions), over max_kv_cache_gb={limit_gb}: lower max_model_len or "
                         f"max_running_requests, or use the sglang backend for this model")


class TorchEngineServer:
    """One engine: lean decoder + continuous batcher + HTTP server on host:port (0 = a free port)."""

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int = 0, max_running_requests: int = 128,
                 device: str | None = None, seed: int = 0, weight_version: int = 0,
                 torch_threads: int | None = None, max_model_len: int | None = None,
                 max_kv_cache_gb: float = 8.0, env: Mapping[str, str] | None = None):
        """env: the SGLang variables this server reads, as SGLang reads its process environment (default
        os.environ); the fleet passes spillover.rollout.sglang.backend.ENGINE_ENV."""
        self.model_path, self.host, self.port = str(model_path), host, port
        self.max_running_requests, self.seed = max_running_requests, seed
        self.device = pick_device(device)
        self.initial_weight_version = weight_version
        self.torch_threads, self.max_model_len = torch_threads, max_model_len
        self.max_kv_cache_gb = max_kv_cache_gb
        env = os.environ if env is None else env
        # SGLang's /health: a generation probe unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false
        self.health_generation = env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in FALSE_WORDS
        self.url = ""
        self.batcher: ContinuousBatcher | None = None
        self.tokenizer = None
        self.live_rids: set[str] = set()  # touched only on the HTTP event loop
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.update_groups: dict[str, tuple[torch.distributed.ProcessGroup, str]] = {}  # name -> (group, backend)
        self.weight_session_open = False  # between /begin_weight_update and /end_weight_update
        # the session and update routes' outcomes in order, the latest few (tests read them: EngineActor)
        self.weight_update_events: deque[str] = deque(maxlen=256)
        self.update_group_timeout_s = 600.0
        self.update_peak_bytes = 0  # the most a weight load held beyond the model (take_update_peak_bytes)
        # (monotonic time, release | resume, ":tags" when not all): colocation's order
        self.memory_events: list[tuple[float, str]] = []

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> str:
        """Load the model, start the engine thread and the HTTP server; block until /health answers."""
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        shape = read_shape(self.model_path)
        dtype = model_dtype(self.model_path, self.device)
        self.shape = shape
        self.max_len = min(shape.max_position, self.max_model_len or shape.max_position)
        check_kv_cache_size(shape, self.max_running_requests, self.max_len, dtype, self.max_kv_cache_gb)
        decoder = LeanDecoder(shape, read_safetensors(self.model_path), dtype, self.device)
        self.batcher = ContinuousBatcher(decoder, self.max_running_requests, self.max_len, seed=self.seed,
                                         weight_version=self.initial_weight_version)
        self.batcher.start()
        self.tokenizer = self._load_tokenizer()
        # proto must be IPPROTO_TCP for asyncio to set TCP_NODELAY on accepted connections; without it
        # Nagle + delayed ACK add ~40 ms to every response with a body
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, timeout_keep_alive=120,
                                backlog=4096)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"engine-http-{self.port}", daemon=True)
        self._thread.start()
        self._wait_healthy(timeout_s)
        return self.url

    def _load_tokenizer(self):
        try:
            from .tokenizer import load_engine_tokenizer

            return load_engine_tokenizer(self.model_path)
        except Exception:  # a checkpoint without a tokenizer still serves token ids
            log.warning("no tokenizer in %s: responses carry no 'text'", self.model_path)
            return None

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError(f"torch engine HTTP server on {self.url} exited during startup")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"torch engine on {self.url} did not answer /health within {timeout_s} s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.batcher is not None:
            self.batcher.stop()

    # ---- requests (called from the HTTP layer) -----------------------------------------------------
    def make_request(self, body: GenerateRequest) -> EngineRequest:
        """Validate a parsed /generate body against the model and build the engine request."""
        ids, params = body.input_ids, body.sampling_params
        if len(ids) >= self.max_len:
            raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.max_len} tokens): shorten input_ids")
        vocab = self.shape.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        rid = body.rid or new_rid()
        if rid in self.live_rids:
            raise BadRequest(f"rid {rid!r} is already in use by a running request: send a unique rid")
        stop = set() if params.ignore_eos else set(params.stop_token_ids or ()) | set(self.shape.eos_token_ids)
        strings, tail = tuple(params.stop or ()), 0
        if strings:
            if self.tokenizer is None:
                raise BadRequest(f"sampling_params.stop needs a tokenizer and {self.model_path} has none: send "
                                 "stop_token_ids instead")
            tail = 1 + max(len(self.tokenizer.encode(s, add_special_tokens=False)) for s in strings)
        return EngineRequest(rid=rid, input_ids=list(ids), params=params, return_logprob=body.return_logprob,
                             max_output=min(self.max_len if params.max_new_tokens is None else params.max_new_tokens,
                                            self.max_len - len(ids)), stop_ids=frozenset(stop),
                             stop_strings=strings, stop_tail_tokens=tail, decode=self._decode_tail if strings else None)

    def _decode_tail(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_text(self, output_ids: list[int], skip_special_tokens: bool) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)

    @property
    def weight_version(self) -> int | str:
        return self.batcher.weight_version if self.batcher else self.initial_weight_version

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds: its weights (fused copies included) and its KV cache."""
        return {"weights": self.batcher.decoder.weight_bytes(), "kv_cache": self.batcher.runner.cache_bytes()}

    # ---- weights ---------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int | str | None,
                     timeout_s: float | None = None) -> None:
        """Apply HF-named tensors once running requests have finished (admission waits meanwhile)."""
        self.apply_weights_future(state_dict, weight_version).result(timeout=timeout_s)

    def apply_weights_future(self, state_dict: dict[str, torch.Tensor], weight_version: int | str | None):
        batcher = self.batcher
        incoming = sum(t.numel() * t.element_size() for t in state_dict.values())

        def apply() -> None:
            with TensorMemoryProbe() as probe:  # a load copies in place: it should allocate nothing
                batcher.decoder.load(state_dict)
            self.update_peak_bytes = max(self.update_peak_bytes, incoming + probe.peak_bytes)
            if weight_version is not None:
                batcher.set_weight_version(weight_version)

        return batcher.call(apply, when_idle=not batcher.paused)  # SGLang: a paused engine takes updates at once

    # ---- the weight-update group (SGLang's distributed update protocol; gloo on CPU) ------------------------
    def join_update_group(self, body: InitWeightsUpdateGroupRequest) -> None:
        """Blocks until every rank of the group has joined (the trainer joins as rank 0 meanwhile)."""
        if body.group_name in self.update_groups:
            raise ValueError(f"group_name {body.group_name!r} is already joined: destroy it first or use another name")
        if body.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA engine and this one runs on {self.device}: send backend 'gloo'")
        group = init_group(body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name,
                           body.backend, self.update_group_timeout_s)
        self.update_groups[body.group_name] = (group, body.backend)

    def leave_update_group(self, group_name: str) -> None:
        if group_name not in self.update_groups:
            raise ValueError(f"group_name {group_name!r} is not a joined weight-update group "
                             f"(joined: {sorted(self.update_groups)})")
        destroy_group(self.update_groups.pop(group_name)[0])

    def receive_weights(self, body: UpdateWeightsFromDistributedRequest) -> dict[str, torch.Tensor]:
        """The bucket's tensors by broadcast from rank 0 (blocking; run off the event loop)."""
        if body.group_name not in self.update_groups:
            raise ValueError(f"group_name {body.group_name!r} is not joined: POST /init_weights_update_group first")
        group, backend = self.update_groups[body.group_name]
        device = self.device if backend == "nccl" else torch.device("cpu")
        return receive_bucket(group, body.names, body.dtypes, body.shapes, device)

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """SGLang's get_weights_by_name: the first truncate_size rows of the named tensor, as float32 lists."""
        weights = self.batcher.decoder.weights
        if name == "lm_head.weight" and self.shape.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in weights:
            raise ValueError(f"name {name!r} is not a weight of this model (e.g. 'model.norm.weight')")
        return weights[name][:truncate_size].float().cpu().tolist()

    def read_weights_from_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        return read_safetensors(model_path)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Torch engine server speaking SGLang's native HTTP API.")
    p.add_argument("--model-path", required=True, help="HF checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stderr)")
    p.add_argument("--max-running-requests", type=int, default=128, help="decode slots")
    p.add_argument("--device", default=None, help="cpu or cuda[:i]; default: cuda when torch sees one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for this process")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-kv-cache-gb", type=float, default=8.0, help="refuse a larger fixed-slot KV cache")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    version = parse_version(args.weight_version)
    server = TorchEngineServer(args.model_path, args.host, args.port, args.max_running_requests, args.device,
                               args.seed, version, args.torch_threads, args.max_model_len, args.max_kv_cache_gb)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    url = server.start()
    print(f"torch engine serving on {url}", file=sys.stderr, flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
