"""The `learner` section: how many ranks train, on what device, in what precision.

Checks that need only the config run in the section (and in `check_learner_batch`, called from RunConfig's
cross-section validator); checks that need the machine or the cluster (CUDA GPUs in Ray, flash attention
installed) run at start, in `check_learner_start`, before any actor is created.
"""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from spillover.infra.config.base import Section

__all__ = ["LearnerConfig", "check_learner_batch", "check_learner_start"]


class LearnerConfig(Section):
    world_size: int = Field(1, ge=1, description="Learner ranks (Ray actors in one placement group, torch.distributed; "
                            "FSDP2 shards parameters, gradients and optimizer state across them when > 1).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu: gloo; cuda: one GPU per rank, NCCL.")
    gpus_per_rank: float = Field(1.0, gt=0, le=1, description="GPUs each rank reserves in Ray (device=cuda); "
                                 "below 1 shares a GPU between ranks or with engines.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy of the ranks (SPREAD: across nodes).")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of forward/backward compute (FSDP2 mixed precision); bfloat16 on GPUs. "
        "Master weights and optimizer state stay float32.")
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype of gradient reduction.")
    gradient_checkpointing: bool = Field(False, description="Recompute decoder layer activations in backward.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel of the learner's model (flash_attention_2 needs flash_attn installed "
        "and device=cuda).")
    cpu_threads: int = Field(1, ge=1, description="torch threads per rank (CPU work: device=cpu compute, "
                             "data preparation).")
    num_cpus_per_rank: float = Field(0.0, ge=0, description="Ray CPUs each rank reserves (0: share with engines).")
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Response tokens projected to the vocabulary at once (lm_head + log_softmax): "
        "logprob memory is chunk x vocabulary, not batch x sequence x vocabulary.")

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if self.attn_implementation == "flash_attention_2" and self.device != "cuda":
            raise ValueError("learner.attn_implementation=flash_attention_2 needs learner.device=cuda; use sdpa")
        return self

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def check_learner_batch(learner: LearnerConfig, samples_per_step: int) -> None:
    """Every rank gets the same number of samples of each mini-batch (FSDP's collectives need equal micro-batch
    counts on all ranks), so world_size must divide the samples of one optimizer step."""
    if samples_per_step % learner.world_size:
        raise ValueError(
            f"learner.world_size ({learner.world_size}) must divide the samples of one optimizer step "
            f"(rollout.global_batch_size x rollout.n_samples_per_prompt / grpo.num_steps_per_rollout = "
            f"{samples_per_step})")


def check_learner_start(learner: LearnerConfig, cluster_resources: dict | None = None) -> None:
    """Refuse at start what this machine or cluster cannot run. cluster_resources: ray.cluster_resources()."""
    if learner.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("learner.attn_implementation=flash_attention_2 but flash_attn is not installed; "
                         "pip install flash-attn, or set learner.attn_implementation=sdpa")
    if learner.device == "cuda":
        gpus = float((cluster_resources or {}).get("GPU", 0))
        needed = learner.world_size * learner.gpus_per_rank
        if gpus < needed:
            raise ValueError(f"learner.device=cuda needs {needed:g} GPUs (learner.world_size x learner.gpus_per_rank) "
                             f"but the Ray cluster has {gpus:g}; set learner.device=cpu or add GPU nodes")
