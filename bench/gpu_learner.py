"""The learner part of bench/gpu_smoke.py (issue 12): a random-init Qwen2 (no download; `0.5b` is Qwen2.5-0.5B's
shape, ~494M parameters) trained by spillover's own LearnerActor without Ray: world_size 1, FSDP2 with bfloat16
parameters on CUDA (float32 on CPU), three iterations of old logprobs + a GRPO update on random token batches.
-> {params, device, param_dtype, tokens_per_step, step_s (each iteration), update_tokens_per_s (median),
peak_gpu_gb}."""
from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SIZES = {  # Qwen2 shapes: hidden, intermediate, layers, heads, kv heads, vocabulary
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def random_qwen2(size: str, folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1e6)
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def random_batch(samples: int, tokens: int, vocab: int, seed: int):
    from rollout.batch import from_sequences

    rng = np.random.default_rng(seed)
    seqs, lengths = [], []
    for _ in range(samples):
        response = int(rng.integers(tokens // 2, tokens))
        seqs.append(rng.integers(2, vocab, 32 + response).tolist())
        lengths.append(response)
    return from_sequences(seqs, lengths, [[-3.0] * n for n in lengths], [[0] * n for n in lengths],
                          advantages=rng.normal(size=samples))


def learner_smoke(size: str, device: str, iterations: int = 3, samples: int = 64, tokens: int = 512,
                  micro_batch: int = 8) -> dict:
    from infra.config import GRPOConfig, OptimizerConfig
    from infra.config_learner import LearnerConfig
    from tasks.learner import LearnerActor

    cuda = device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_qwen2(size, Path(tmp) / size)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        lcfg = LearnerConfig(world_size=1, device=device, param_dtype="bfloat16" if cuda else "float32",
                             gradient_checkpointing=cuda)
        learner = LearnerActor(str(model_dir), GRPOConfig(micro_batch_size=micro_batch, kl_coef=0.0),
                               OptimizerConfig(), 1.0, 0, True, learner_cfg=lcfg, master=("127.0.0.1", port))
    params = sum(p.numel() for p in learner.model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_s, tokens_per_step = [], 0
    for k in range(iterations):
        batch = random_batch(samples, tokens, SIZES[size]["vocab_size"], k)
        tokens_per_step = int(batch.seq_lengths.sum())
        tic = time.perf_counter()
        learner.update(batch, learner.compute_logprobs(batch))
        if cuda:
            torch.cuda.synchronize()
        step_s.append(round(time.perf_counter() - tic, 3))
    if learner.sharded:
        torch.distributed.destroy_process_group()
    return {"size": size, "params": int(params), "device": device, "param_dtype": lcfg.param_dtype,
            "tokens_per_step": tokens_per_step, "step_s": step_s,
            "update_tokens_per_s": round(tokens_per_step / float(np.median(step_s)), 1),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0}
