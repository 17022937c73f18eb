"""The `learner` section: how many ranks train, on what device, in what precision.

Checks that need only the config run in the section (and in `check_learner_batch`, called from RunConfig's
cross-section validator); checks that need the machine or the cluster (CUDA GPUs in Ray, flash attention
installed) run at start, in `check_learner_start`, before any actor is created.
"""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from .base import Section

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
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Micro-batches by tokens instead of by count (verl's use_dynamic_bsz / "
        "ppo_max_token_len_per_gpu): each rank's share of a step is cut into few micro-batches of at most this many "
        "tokens (prompt + response) with balanced token sums, the same number on every rank; "
        "grpo.micro_batch_size then no longer sizes forward passes. Must be >= rollout.max_model_len. Empty: "
        "grpo.micro_batch_size samples per micro-batch.")
    pack_sequences: bool = Field(
        True, description="With max_tokens_per_micro_batch: each micro-batch is one packed row (its sequences "
        "concatenated, position ids restarting per sequence, attention within each sequence: torch's varlen flash "
        "attention on CUDA, flash_attn with attn_implementation=flash_attention_2, per-sequence SDPA on CPU), so "
        "no position is padding. false: padded rows. No effect on count micro-batches (always padded).")
    deterministic: bool = Field(
        True, description="torch.use_deterministic_algorithms in the learner's process (warn only): the CPU runs' "
        "bit-exact resume; on CUDA it selects slower kernels, so the GPU recipes turn it off.")
    reference_placement: Literal["with_policy", "with_policy_offloaded", "separate"] = Field(
        "with_policy", description="Where the KL reference (grpo.kl_coef > 0: the frozen initial model) computes its "
        "logprobs. with_policy: inside the policy's ranks, on their devices, sharded like the policy, with no "
        "gradients or optimizer state; its float32 weights stay resident (4 bytes per parameter / world_size on each "
        "rank). with_policy_offloaded: the same, its weights in pinned host memory between uses, copied back for "
        "each reference pass, for GPUs too full to keep them (on device=cpu it saves nothing). separate: a learner "
        "group of its own (learner.world_size more ranks, and their GPUs on device=cuda). The logprobs are the same "
        "in all three.")

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if self.attn_implementation == "flash_attention_2" and self.device != "cuda":
            raise ValueError("learner.attn_implementation=flash_attention_2 needs learner.device=cuda; use sdpa")
        return self

    @property
    def packs_sequences(self) -> bool:
        """Micro-batches are packed rows: a token budget and pack_sequences."""
        return self.max_tokens_per_micro_batch is not None and self.pack_sequences

    @property
    def reference_with_policy(self) -> bool:
        """The policy's ranks hold the KL reference (when grpo.kl_coef > 0), resident or offloaded."""
        return self.reference_placement != "separate"

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def check_learner_batch(learner: LearnerConfig, samples_per_step: int, max_model_len: int) -> None:
    """Every rank gets the same number of samples of each mini-batch (FSDP's collectives need equal micro-batch
    counts on all ranks), so world_size must divide the samples of one optimizer step. A token budget must hold the
    longest sequence a rollout can make (as verl requires), so that no micro-batch is over it."""
    budget = learner.max_tokens_per_micro_batch
    if budget is not None and budget < max_model_len:
        raise ValueError(f"learner.max_tokens_per_micro_batch ({budget}) must be >= rollout.max_model_len "
                         f"({max_model_len}), the longest sequence a micro-batch may have to hold")
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
