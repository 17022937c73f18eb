"""A lean torch forward of Qwen2 / Llama-style decoders over the HF weights, with a fixed-slot KV cache.

Why not the HF forward: on small models the per-step Python overhead of HF's modules dominates, and
the engine needs per-slot positions into one preallocated cache. This forward fuses q/k/v and
gate/up into single matmuls and computes exactly what HF's eager Qwen2 computes (fp32 softmax,
rotate-half RoPE, RMSNorm), so logits match HF's to float rounding.

Weights stay keyed by their HF names (`model.layers.0.self_attn.q_proj.weight`, ...) so weight
updates from a learner's `state_dict()` or from safetensors files apply by name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3")


@dataclass(frozen=True)
class DecoderShape:
    """The shape numbers of a decoder-only model, read from an HF config.json."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config: dict) -> "DecoderShape":
        model_type = config.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"torch engine: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}); use the sglang backend for other models")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"torch engine: rope type {rope.get('rope_type')!r} is not supported (default only)")
        heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
            num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config["vocab_size"],
            max_position=config.get("max_position_embeddings", 2048), rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
        )


def read_shape(model_path: str | Path) -> DecoderShape:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path {str(model_path)!r} has no config.json: point it at an HF folder")
    return DecoderShape.from_config(json.loads(path.read_text()))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, or of every *.safetensors file in a folder (CPU tensors)."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"model_path {str(p)!r} holds no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


class KVCache:
    """Per-layer key/value tensors `[slots, kv_heads, max_len, head_dim]`; a slot holds one sequence."""

    def __init__(self, shape: DecoderShape, slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        size = (slots, shape.num_kv_heads, max_len, shape.head_dim)
        self.k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.slots, self.max_len = slots, max_len


def _read(cache: torch.Tensor, group: "AttnGroup") -> torch.Tensor:
    """cache[group.rows, :, :kv_len]: a view for a slice, an index_select copy for slots (much faster
    on CPU than advanced indexing)."""
    span = cache[:, :, :group.kv_len]
    return span[group.rows] if isinstance(group.rows, slice) else span.index_select(0, group.rows)


@dataclass
class AttnGroup:
    """Batch rows that attend over the same cache span: batch_index [n] (None = all rows, in order),
    rows: their cache slots (a slice reads a view, a LongTensor gathers), kv_len: keys to read."""

    batch_index: torch.Tensor | None
    rows: torch.Tensor | slice
    kv_len: int


class LeanDecoder:
    """Fused-weight decoder forward. `weights` is the HF-named state dict (updated in place by name)."""

    def __init__(self, shape: DecoderShape, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.weights: dict[str, torch.Tensor] = {}
        self.load(weights, strict=True)
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim))
        freqs = torch.outer(torch.arange(shape.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    def load(self, tensors: dict[str, torch.Tensor], strict: bool = False) -> None:
        """Copy HF-named tensors in, in place (a load allocates nothing); unknown names raise, and with `strict` so
        do missing ones. The first load (strict) lays the weights out (_build)."""
        expected = set(self.expected_names())
        tensors = {("model.embed_tokens.weight" if k == "lm_head.weight" and self.shape.tie_word_embeddings else k): v
                   for k, v in tensors.items()}
        unknown = sorted(set(tensors) - expected - {"lm_head.weight"} - {k for k in tensors if "rotary_emb" in k})
        if unknown:
            raise ValueError(f"weights: unknown tensor names {unknown[:5]} (expected HF names like "
                             f"'model.layers.0.self_attn.q_proj.weight')")
        missing = sorted(expected - set(tensors) - set(self.weights))
        if strict and missing:
            raise ValueError(f"weights: missing tensors {missing[:5]}")
        if not self.weights:
            if not strict:
                raise ValueError("weights are released: resume_memory_occupation first")
            self._build({name: tensors[name] for name in expected})
            return
        for name, value in tensors.items():
            if name in expected:
                target = self.weights[name]
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(f"weights: {name} has shape {tuple(value.shape)}, the model needs "
                                     f"{tuple(target.shape)}")
                target.copy_(value.detach())

    def _build(self, tensors: dict[str, torch.Tensor]) -> None:
        """Own copies of every weight, laid out for the forward: q/k/v (weights, biases) and gate/up rows
        concatenated once, with their HF names as views into them, so a load writes each tensor in place."""
        s, w = self.shape, {}

        def fused(names: list[str]) -> torch.Tensor:
            whole = torch.cat([tensors[n].detach().to(self.device, self.dtype) for n in names])
            w.update(zip(names, whole.split([tensors[n].shape[0] for n in names])))
            return whole

        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            layer = dict(qkv_w=fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                         qkv_b=fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"]) if s.model_type == "qwen2" else None,
                         gate_up_w=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]))
            self.layers.append(layer)
        for name, value in tensors.items():
            if name not in w:
                w[name] = value.detach().to(self.device, self.dtype, copy=True)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.update(ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                         o_w=w[p + "self_attn.o_proj.weight"], down_w=w[p + "mlp.down_proj.weight"],
                         q_norm=w.get(p + "self_attn.q_norm.weight"), k_norm=w.get(p + "self_attn.k_norm.weight"))
        self.weights = w
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if s.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]

    def release_weights(self) -> None:
        """Free every weight tensor (release_memory_occupation); their shapes stay for alloc_weights."""
        if self.weights:
            self.released_shapes = {name: tuple(t.shape) for name, t in self.weights.items()}
        self.weights, self.layers, self.embed, self.lm_head, self.final_norm = {}, [], None, None, None

    def alloc_weights(self) -> None:
        """Weights again after release_weights: zeros until the next load brings their values."""
        if not self.weights:
            self._build({n: torch.zeros(shape, dtype=self.dtype) for n, shape in self.released_shapes.items()})

    def weight_bytes(self) -> int:
        """Bytes the weights hold (each storage once: the fused tensors and the HF-named views share theirs)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.weights.values()}
        return sum(storages.values())

    def expected_names(self) -> list[str]:
        s = self.shape
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not s.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                      "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                      "mlp.down_proj.weight")]
            if s.model_type == "qwen2":
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if s.model_type == "qwen3":
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _mask_bias(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Additive attention mask [n*Hkv, G*T, kv_len]: key j is visible to a query at position p iff j <= p."""
        n, T = positions.shape
        Hkv, G = self.shape.num_kv_heads, self.shape.num_heads // self.shape.num_kv_heads
        blocked = torch.arange(kv_len, device=self.device).view(1, 1, kv_len) > positions.unsqueeze(-1)
        bias = torch.zeros((n, Hkv, G, T, kv_len), dtype=self.dtype, device=self.device)
        bias.masked_fill_(blocked.view(n, 1, 1, T, kv_len), float("-inf"))
        return bias.view(n * Hkv, G * T, kv_len)

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q [n, Hkv, G*T, D], keys/values [n, Hkv, K, D] -> [n, Hkv, G*T, D] (fp32 softmax)."""
        n, Hkv, GT, D = q.shape
        K = keys.shape[2]
        scores = torch.baddbmm(bias, q.reshape(n * Hkv, GT, D), keys.reshape(n * Hkv, K, D).transpose(1, 2),
                               alpha=scale)
        probs = scores.softmax(-1) if scores.dtype == torch.float32 else scores.float().softmax(-1).to(q.dtype)
        return torch.bmm(probs, values.reshape(n * Hkv, K, D)).view(n, Hkv, GT, D)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, write_rows: torch.Tensor,
                groups: list[AttnGroup] | None, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of one step.

        tokens, positions: [B, T]. The step's keys/values go to cache[write_rows[b], :, positions[b]].
        groups None: a prefill from position 0, attending to the step's own keys/values. Otherwise each
        AttnGroup attends its batch rows to cache[group.rows, :, :group.kv_len] (rows with similar
        lengths share a group, so short rows do not pay for the longest). last_index: [B] -> logits
        [B, V] at that position of each row; None -> [B, T, V].
        """
        s = self.shape
        B, T = tokens.shape
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        G = H // Hkv
        flat_pos = positions.reshape(-1)
        cos = self.cos.index_select(0, flat_pos).view(B, T, 1, D)
        sin = self.sin.index_select(0, flat_pos).view(B, T, 1, D)
        if groups is None:
            biases = [self._mask_bias(positions, T)]
        else:
            biases = [self._mask_bias(positions if g.batch_index is None else positions.index_select(0, g.batch_index),
                                      g.kv_len) for g in groups]
        # flat row of cache[slot, head, position] in a [slots*Hkv*max_len, D] view (index_copy_ is fast on CPU)
        heads = torch.arange(Hkv, device=self.device).view(1, 1, Hkv)
        write_index = ((write_rows.view(B, 1, 1) * Hkv + heads) * cache.max_len + positions.view(B, T, 1)).view(-1)
        scale, eps, hidden = 1.0 / math.sqrt(D), s.rms_norm_eps, (s.hidden_size,)
        half = D // 2
        h = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, hidden, layer["ln1"], eps)
            qkv = F.linear(x, layer["qkv_w"], layer["qkv_b"])
            qk = qkv[..., :(H + Hkv) * D].view(B, T, H + Hkv, D)
            v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D)
            if layer["q_norm"] is not None:
                qk = torch.cat([F.rms_norm(qk[:, :, :H], (D,), layer["q_norm"], eps),
                                F.rms_norm(qk[:, :, H:], (D,), layer["k_norm"], eps)], dim=2)
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin  # RoPE, rotate-half
            k = qk[:, :, H:]
            cache_k, cache_v = cache.k[i], cache.v[i]
            cache_k.view(-1, D).index_copy_(0, write_index, k.reshape(-1, D))
            cache_v.view(-1, D).index_copy_(0, write_index, v.reshape(-1, D))
            # [B, Hkv, G*T, D]: query head h uses kv head h // G, as HF's repeat_kv
            q = qk[:, :, :H].transpose(1, 2).reshape(B, Hkv, G * T, D)
            if groups is None:
                attn = self._attend(q, k.transpose(1, 2), v.transpose(1, 2), biases[0], scale)
            elif len(groups) == 1 and groups[0].batch_index is None:
                keys, values = _read(cache_k, groups[0]), _read(cache_v, groups[0])
                attn = self._attend(q, keys, values, biases[0], scale)
            else:
                attn = torch.empty_like(q)
                for g, bias in zip(groups, biases):
                    part = self._attend(q.index_select(0, g.batch_index), _read(cache_k, g), _read(cache_v, g),
                                        bias, scale)
                    attn.index_copy_(0, g.batch_index, part)
            attn = attn.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
            h = h + F.linear(attn, layer["o_w"])
            x = F.rms_norm(h, hidden, layer["ln2"], eps)
            gate, up = F.linear(x, layer["gate_up_w"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down_w"])
        if last_index is not None:
            h = h[:, 0] if T == 1 else h[torch.arange(B, device=self.device), last_index]
        return F.linear(F.rms_norm(h, hidden, self.final_norm, eps), self.lm_head).float()
