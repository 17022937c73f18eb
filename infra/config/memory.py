"""A rough memory estimate per GPU for a placement plan (infra/config/placement_plan.py), from the model's config.json.

Learner ranks hold float32 master weights, gradients and AdamW's two moments (16 B per parameter), sharded over
learner.world_size by FSDP2; activations come on top. The reference holds float32 weights, sharded the same way: on
GPUs of its own, or on the policy's (learner.reference_placement=with_policy; with_policy_offloaded: in host memory
between uses). An engine holds
its weights (split over engines.gpus_per_engine) and a KV pool: SGLang takes mem_fraction_static of the GPU for both,
so the estimate says what KV cache every decode slot at full length would need (max_running_requests x
max_model_len tokens). Pure functions; nothing is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape", "memory_lines", "model_shape"]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LEARNER_BYTES_PER_PARAM = 16  # fp32 master 4 + fp32 gradient 4 + AdamW exp_avg 4 + exp_avg_sq 4
MASTER_BYTES = 4  # the reference loads as the policy does, in float32 (tasks/learner_dist.MASTER_DTYPE)


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    kv_heads: int
    head_dim: int


def model_shape(hf: dict) -> ModelShape:
    """An HF decoder's config.json (Qwen2/Llama style) -> its parameter count and KV shape (approximate: norms
    and biases left out)."""
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    inter, vocab = int(hf["intermediate_size"]), int(hf["vocab_size"])
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    embeddings = vocab * hidden * (1 if hf.get("tie_word_embeddings", False) else 2)
    return ModelShape(embeddings + layers * (attention + 3 * hidden * inter), layers, kv_heads, head_dim)


def memory_lines(plan, cfg, shape: ModelShape) -> list[str]:
    """One line per kind of GPU actor of `plan`: '<name>: ~X GiB per GPU (what)'."""
    lines, p = [], shape.params
    dtype = DTYPE_BYTES[cfg.model.dtype]
    world = cfg.learner.world_size
    for group in plan.groups:
        if group.name == "policy learner" and group.gpus:
            size = _size(LEARNER_BYTES_PER_PARAM * p / world)
            extra = ""
            if cfg.placement.colocate:
                extra = "; the colocated engine's weights and KV pool are released while it trains"
            held = f"fp32 weights, gradients and AdamW state of {_count(p)} parameters"
            placement = cfg.learner.reference_placement
            if cfg.grpo.kl_coef > 0 and placement == "with_policy":
                size = _size((LEARNER_BYTES_PER_PARAM + MASTER_BYTES) * p / world)
                held += ", and the KL reference's fp32 weights (learner.reference_placement=with_policy)"
            elif cfg.grpo.kl_coef > 0 and placement == "with_policy_offloaded":
                extra += f"; the KL reference's ~{_size(MASTER_BYTES * p / world)} only during its pass ({placement})"
            lines.append(f"policy learner: ~{size} per GPU ({held} / {world} rank(s); activations extra{extra})")
        elif group.name == "reference learner" and group.gpus:
            lines.append(f"reference learner: ~{_size(MASTER_BYTES * p / world)} per GPU (float32 weights, "
                         f"loaded as the policy's / {world} rank(s))")
        elif group.name == "engine" and (group.gpus or cfg.placement.colocate and cfg.learner.device == "cuda"):
            lines.append(_engine_line(cfg, shape, dtype))
    return lines


def _engine_line(cfg, shape: ModelShape, dtype: int) -> str:
    engines, rollout = cfg.engines, cfg.rollout
    tp = 1 if cfg.placement.colocate else engines.gpus_per_engine
    weights = _size(dtype * shape.params / tp)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype / tp
    kv = _size(engines.max_running_requests * rollout.max_model_len * kv_per_token)
    pool = ""
    if engines.backend == "sglang":
        fraction = engines.sglang_args.get("mem_fraction_static")
        pool = f"; SGLang takes {fraction} of the GPU for both" if fraction else \
            "; SGLang takes mem_fraction_static of the GPU for both (its own choice when unset)"
    return (f"engine: ~{weights} weights per GPU + ~{kv} KV cache for all "
            f"{engines.max_running_requests} slots at {rollout.max_model_len} tokens (engines.max_running_requests x "
            f"rollout.max_model_len){pool}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / 2**20:.1f} MiB"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
