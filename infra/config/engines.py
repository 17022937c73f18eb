"""The `engines` section: the inference engines (backend, GPUs, slots), the router, health checks, how weights reach
the engines, and SGLang's own server flags."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")  # sglang-router 0.3.2's regular ones


class EnginesConfig(Section):
    backend: Literal["torch", "sglang"] = Field("torch", description="torch: CPU/GPU engine of ours; sglang: GPU.")
    rollout_num_gpus: int = Field(2, ge=1, description="Accelerators (or CPU slots) for rollout in all.")
    gpus_per_engine: int = Field(1, ge=1, description="Accelerators per engine (tensor parallel size).")
    num_cpus_per_engine: float = Field(0.0, ge=0, description="Ray CPUs reserved per CPU engine actor.")
    max_running_requests: int = Field(128, ge=1, description="Decode slots per engine.")
    router_address: str | None = Field(None, description="External sglang-router URL; empty = start one.")
    health_timeout_s: float = Field(30.0, gt=0, description="A /health_generate slower than this is dead.")
    health_interval_s: float = Field(30.0, ge=0, description="Background engine health check every this many "
                                     "seconds (dead or hung engines are restarted); 0 = off.")
    ray_address: str | None = Field(None, description="Ray cluster address; empty = RAY_ADDRESS or local.")

    weight_sync: Literal["distributed", "tensor", "disk"] = Field(
        "tensor", description="How new weights reach the engines: distributed = SGLang's weight-update group (the "
        "learner's rank 0 broadcasts bucket by bucket; NCCL on GPUs, gloo on CPU); tensor = the whole state dict "
        "through Ray's object store; disk = an HF folder the learner writes (engines.weight_sync_dir).")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="rollout.overlap: how a weight update treats the requests still running (SGLang's "
        "/pause_generation mode). retract (the default: no token lost, and every token after the update is sampled "
        "from the new weights alone, so its recorded version is exact): they wait, their KV cache is freed and "
        "recomputed from prompt + output after the new weights load, and go on. in_place: they keep their KV cache "
        "(no recompute: the cheapest pause; the update skips its cache flush), so tokens after the update attend to "
        "keys and values the old weights computed while recorded as the new version. abort: they end at the pause "
        "with their tokens so far, kept in the dock and continued next iteration (their KV recomputed then).")
    weight_bucket_bytes: int = Field(
        512 * 2**20, gt=0, description="Bytes per weight-update bucket (whole tensors; a larger tensor goes alone): a "
        "broadcast (distributed) or one /update_weights_from_tensor call (tensor, colocated). Neither end holds more "
        "than about one bucket beyond its model.")
    weight_sync_timeout_s: float = Field(
        600.0, gt=0, description="distributed: rendezvous and per-bucket timeout of the weight-update group.")
    weight_sync_dir: str | None = Field(
        None, description="disk: where the learner exports each version (every engine must read it), as "
        "version-N, written whole before the engines read it; the version before is deleted once the engines serve "
        "the new one. Empty = next to the model folder.")
    sglang_args: dict[str, Any] = Field(
        default_factory=dict, description="sglang backend: extra server flags as SGLang ServerArgs field names "
        "(e.g. {mem_fraction_static: 0.7, context_length: 8192, chunked_prefill_size: 4096, "
        "cuda_graph_max_bs_decode: 256, attention_backend: fa3}); checked against SGLang 0.5.23's fields.")
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] | None = Field(
        None, description="sglang-router policy; empty = cache_aware for the sglang backend, round_robin for torch.")

    @model_validator(mode="after")
    def _check(self) -> "EnginesConfig":
        if self.rollout_num_gpus % self.gpus_per_engine:
            raise ValueError(f"engines.rollout_num_gpus ({self.rollout_num_gpus}) must be a multiple of "
                             f"engines.gpus_per_engine ({self.gpus_per_engine})")
        return self

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.gpus_per_engine

    @field_validator("sglang_args")
    @classmethod
    def _known_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        from .sglang_flags import check_sglang_args

        return check_sglang_args(v)

    def resolved_router_policy(self, backend: str) -> str:
        return self.router_policy or ("cache_aware" if backend == "sglang" else "round_robin")
