"""What the torch engine's HTTP routes (http_app.py, weight_routes.py) need of the engine they serve: declared here
so the routes depend on this interface and server.py (which builds the app) on the routes, never both ways."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from ..sglang.protocol import GenerateRequest, InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest
from .batcher import ContinuousBatcher, EngineRequest


class ServedEngine(Protocol):
    model_path: str
    device: torch.device
    max_len: int
    batcher: ContinuousBatcher | None
    health_generation: bool  # SGLang's /health runs a one-token generation unless its variable turns it off
    live_rids: set[str]  # touched only on the HTTP event loop
    weight_session_open: bool  # between /begin_weight_update and /end_weight_update
    weight_update_events: deque[str]
    memory_events: list[tuple[float, str]]

    @property
    def weight_version(self) -> int | str: ...

    def make_request(self, body: GenerateRequest) -> EngineRequest: ...

    def decode_text(self, output_ids: list[int], skip_special_tokens: bool) -> str | None: ...

    def apply_weights_future(self, state_dict: dict[str, torch.Tensor], weight_version: int | str | None) -> Future: ...

    def read_weights_from_disk(self, model_path: str | Path) -> dict[str, torch.Tensor]: ...

    def join_update_group(self, body: InitWeightsUpdateGroupRequest) -> None: ...

    def leave_update_group(self, group_name: str) -> None: ...

    def receive_weights(self, body: UpdateWeightsFromDistributedRequest) -> dict[str, torch.Tensor]: ...

    def weights_by_name(self, name: str, truncate_size: int) -> list: ...
