"""`WeightPoster`: the HTTP client side of SGLang's tensor weight update for one engine's node 0, used by the engine
actor, the colocated learner ranks and the GPU smoke checks (which have no Ray).

SGLang 0.5.23 refuses /update_weights_from_tensor outside /begin_weight_update ... /end_weight_update, so an update
is one session around all its buckets (`update`), ended also when a bucket fails, so that the next update can begin.
The torch engine enforces the same rule. SGLang gets its own JSON body (CUDA IPC handles); the torch engine gets the
tensors' data as a binary safetensors body, streamed tensor by tensor (rollout/sglang/tensor_wire.py), because base64
inside JSON took 150 s for Qwen2.5-0.5B's 2 GB of float32 weights on these CPUs.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from .weight_update import reported_version
from ...sglang import backend as sgl
from ...sglang.protocol import (BeginWeightUpdateRequest, EndWeightUpdateRequest, ModelInfo, TensorUpdateFields,
                                UpdateWeightsFromTensorRequest)
from ...sglang.tensor_wire import SAFETENSORS_MEDIA_TYPE, blob_size, safetensors_chunks

log = logging.getLogger(__name__)
BUCKET_TIMEOUT_S = 600.0  # one bucket's load: an SGLang engine not paused waits for its running requests first


def stream_buckets(named: Iterable[tuple[str, Any]],
                   bucket_bytes: int | None) -> Iterator[tuple[dict[str, Any], bool]]:
    """(bucket, is_last): consecutive tensors grouped as plan_buckets groups their specs (at most bucket_bytes each, a
    larger tensor alone; None: one bucket). A bucket is yielded once the next tensor does not fit, and not kept here
    after: with tensors produced as needed, a bucket and one tensor are held at a time."""
    current: dict[str, Any] = {}
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and bucket_bytes and size + nbytes > bucket_bytes:
            bucket, current, size = current, {}, 0
            yield bucket, False
            del bucket
        current[name] = tensor
        size += nbytes
        del tensor
    if current:
        bucket, current = current, {}
        yield bucket, True


@dataclass
class WeightPoster:
    url: str
    backend: str  # "torch" | "sglang"
    tp_size: int = 1
    base_gpu_id: int = 0
    label: str = "engine"  # for error messages, e.g. "engine 3"
    # one connection for a whole session: a new httpx client per post builds an SSL context each time (~45 ms here)
    http: httpx.Client | None = field(default=None, init=False, repr=False)

    def update(self, named: Mapping[str, Any] | Iterable[tuple[str, Any]], weight_version: int,
               bucket_bytes: int | None = None, flush_cache: bool = True) -> int:
        """HF-named tensors (a state dict, or (name, tensor) pairs produced as needed: EngineActor fetches them from
        Ray's object store) in buckets of about bucket_bytes (None: one) inside one session; the last bucket sets
        weight_version and flushes the cache (flush_cache=False: not, as requests paused in_place hold theirs).
        Each bucket is dropped once posted, so pairs produced as needed hold at most one bucket and the next tensor.
        Returns the version the engine reports."""
        pairs = named.items() if isinstance(named, Mapping) else named
        with self.session():
            for tensors, last in stream_buckets(pairs, bucket_bytes):
                self.post_bucket(tensors, weight_version if last else None, flush_cache=last and flush_cache)
                del tensors  # before the next bucket's tensors arrive
        self.drop_device_cache()
        return self.reported_version()

    def drop_device_cache(self) -> None:
        """SGLang: the last bucket's GPU blocks go back to the device (torch's caching allocator would keep them from
        the engine). Only where this process already uses CUDA: the torch engine's posts never touch it."""
        if self.backend == "sglang":
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    @contextmanager
    def session(self):
        """/begin_weight_update ... /end_weight_update over one connection; the session is ended also when the body
        fails."""
        with self.connection():
            self.post(sgl.ENDPOINTS["begin_weight_update"], BeginWeightUpdateRequest().model_dump(),
                      sgl.CONTROL_TIMEOUT_S)
            try:
                yield
            except BaseException:
                try:
                    self.post(sgl.ENDPOINTS["end_weight_update"], EndWeightUpdateRequest().model_dump(),
                              sgl.CONTROL_TIMEOUT_S)
                except Exception as err:  # the update's own error is the one to report
                    log.warning("%s: /end_weight_update after a failed update failed too: %r", self.label, err)
                raise
            self.post(sgl.ENDPOINTS["end_weight_update"], EndWeightUpdateRequest().model_dump(), sgl.CONTROL_TIMEOUT_S)

    @contextmanager
    def connection(self):
        """Posts inside share one httpx client (and its connection to the engine)."""
        with httpx.Client() as http:
            self.http = http
            try:
                yield
            finally:
                self.http = None

    def post_bucket(self, tensors: dict[str, Any], weight_version: int | None, flush_cache: bool = True) -> None:
        """One /update_weights_from_tensor call (inside a session); weight_version None keeps the engine's version.
        SGLang: CUDA IPC handles, so the tensors go to this engine's GPU first (one bucket there at a time) and stay
        alive until the call returns. Torch engine: the tensors' data as a safetensors body, streamed."""
        path = sgl.ENDPOINTS["update_from_tensor"]
        fields = {"weight_version": weight_version, "flush_cache": flush_cache}
        if self.backend == "torch":
            named = list(tensors.items())
            self.send(path, BUCKET_TIMEOUT_S, params=TensorUpdateFields(**fields).query(),
                      content=safetensors_chunks(named),
                      headers={"Content-Type": SAFETENSORS_MEDIA_TYPE, "Content-Length": str(blob_size(named))})
            return
        device = f"cuda:{self.base_gpu_id}"
        tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
        serialized = sgl.serialize_named_tensors(list(tensors.items()), self.tp_size, backend=self.backend)
        self.post(path, UpdateWeightsFromTensorRequest(serialized_named_tensors=serialized, **fields).model_dump())

    def reported_version(self) -> int:
        info = ModelInfo.model_validate_json(httpx.get(self.url + sgl.ENDPOINTS["model_info"], timeout=30.0).content)
        return reported_version(info.weight_version, self.label)

    def post(self, path: str, payload: dict[str, Any], timeout_s: float = BUCKET_TIMEOUT_S) -> dict[str, Any]:
        """POST a JSON body; a non-200 answer or success:false raises RuntimeError naming the route and engine."""
        return self.send(path, timeout_s, json=payload)

    def send(self, path: str, timeout_s: float, **request: Any) -> dict[str, Any]:
        """POST (request: httpx.post's json, or content and headers); a non-200 answer or success:false raises
        RuntimeError naming the route and engine, no answer within timeout_s httpx.TimeoutException."""
        response = (self.http or httpx).post(self.url + path, timeout=timeout_s, **request)
        body = response.json() if response.content else {}
        if response.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            message = body.get("message", response.text) if isinstance(body, dict) else response.text
            raise RuntimeError(f"{path} on {self.label} ({self.url}) failed: {response.status_code} {message[:500]}")
        return body
