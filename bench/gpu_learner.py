"""The learner part of bench/gpu_smoke.py (issues 12, 28): a random-init Qwen2 (no download; `0.5b` is Qwen2.5-0.5B's
shape, ~494M parameters) trained by spillover's own LearnerActor without Ray, with a GPU recipe's precision and
optimizer settings (model.dtype, learner.param_dtype / reduce_dtype, optimizer, grpo; default
configs/gpu/qwen2.5-0.5b-math.yaml): world_size 1, FSDP2 on CUDA (autocast on CPU), three iterations of old logprobs
+ a GRPO update on random token batches.

-> {size, recipe, params, device, model_dtype, param_dtype, reduce_dtype, lr, master_dtypes / optimizer_state_dtypes
(float32: the masters), compute_dtypes (what a decoder matmul produced: param_dtype), sent_dtypes (what engines get:
model.dtype), moved_share (share of weights the first update changed, at the recipe's lr 1e-6), tokens_per_step,
step_s (each iteration), update_tokens_per_s (median), peak_gpu_gb}."""
from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = ROOT / "configs" / "gpu" / "qwen2.5-0.5b-math.yaml"
SIZES = {  # Qwen2 shapes: hidden, intermediate, layers, heads, kv heads, vocabulary
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def random_qwen2(size: str, folder: Path, dtype: torch.dtype = torch.float32, tokenizer: bool = False) -> Path:
    """A random-init Qwen2 of SIZES[size] saved as an HF folder in `dtype` (the recipes' checkpoints are bfloat16);
    tokenizer: also a small char-level tokenizer (servers that load one; token ids are what the checks send)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1e6)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        from spillover.infra.models import build_char_tokenizer

        build_char_tokenizer().save_pretrained(folder)
    return folder


def random_batch(samples: int, tokens: int, vocab: int, seed: int):
    from spillover.rollout.batch import from_sequences

    rng = np.random.default_rng(seed)
    seqs, lengths = [], []
    for _ in range(samples):
        response = int(rng.integers(tokens // 2, tokens))
        seqs.append(rng.integers(2, vocab, 32 + response).tolist())
        lengths.append(response)
    return from_sequences(seqs, lengths, [[-3.0] * n for n in lengths], [[0] * n for n in lengths],
                          advantages=rng.normal(size=samples))


def recipe_settings(recipe: str | Path, device: str, micro_batch: int | None = None):
    """A recipe's (model.dtype, learner section at world_size 1 on `device`, grpo without the reference, optimizer)."""
    from spillover.infra.config.run_config import load_config

    cfg = load_config(recipe)
    lcfg = cfg.learner.model_copy(update={"world_size": 1, "device": device})
    grpo = cfg.grpo.model_copy(update={"kl_coef": 0.0, **({"micro_batch_size": micro_batch} if micro_batch else {})})
    return cfg.model.dtype, lcfg, grpo, cfg.optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def learner_smoke(size: str, device: str, iterations: int = 3, samples: int = 64, tokens: int = 512,
                  micro_batch: int | None = None, recipe: str | Path = DEFAULT_RECIPE) -> dict:
    from spillover.tasks.learner.actor import LearnerActor

    cuda = device == "cuda"
    model_dtype, lcfg, grpo, optim = recipe_settings(recipe, device, micro_batch)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_qwen2(size, Path(tmp) / size, getattr(torch, model_dtype))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        learner = LearnerActor(str(model_dir), grpo, optim, 1.0, 0, True, dtype=model_dtype, learner_cfg=lcfg,
                               master=("127.0.0.1", port), total_steps=iterations)
    compute: set[str] = set()
    learner.model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: compute.add(str(out.dtype).removeprefix("torch.")))
    params = sum(p.numel() for p in learner.model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = [_local(p).detach().clone() for p in learner.model.parameters()]
    step_s, tokens_per_step, moved = [], 0, 0
    for k in range(iterations):
        batch = random_batch(samples, tokens, SIZES[size]["vocab_size"], k)
        tokens_per_step = int(batch.seq_lengths.sum())
        tic = time.perf_counter()
        learner.update(batch, learner.compute_logprobs(batch))
        if cuda:
            torch.cuda.synchronize()
        step_s.append(round(time.perf_counter() - tic, 3))
        if k == 0:
            moved = sum(int((_local(p).detach() != b).sum()) for p, b in zip(learner.model.parameters(), before))
            del before
    dtypes = lambda ts: sorted({str(t.dtype).removeprefix("torch.") for t in ts})  # noqa: E731
    out = {"size": size, "recipe": Path(recipe).name, "params": int(params), "device": device,
           "model_dtype": model_dtype, "param_dtype": lcfg.param_dtype, "reduce_dtype": lcfg.reduce_dtype,
           "lr": optim.lr, "master_dtypes": dtypes(learner.model.parameters()),
           "optimizer_state_dtypes": dtypes(v for s in learner.optimizer.state.values() for n, v in s.items()
                                            if n != "step"),
           "compute_dtypes": sorted(compute), "sent_dtypes": sorted({d for _, d, _ in learner.weight_specs()}),
           "moved_share": round(moved / params, 4), "tokens_per_step": tokens_per_step, "step_s": step_s,
           "update_tokens_per_s": round(tokens_per_step / float(np.median(step_s)), 1),
           "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0}
    if learner.sharded:
        torch.distributed.destroy_process_group()
    return out
