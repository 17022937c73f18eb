"""Learner at world_size 1 vs 2 (FSDP2, gloo on CPU / NCCL on CUDA) and logprob memory with and without chunks.

Ranks are plain processes (torch.multiprocessing, no Ray: the GPU machine has none), each a spillover.tasks.learner.actor
LearnerActor with learner.world_size ranks. Prints one JSON line:
  world_size, state_bytes_ratio (per-rank parameter + gradient + optimizer bytes at world_size 2 / at 1),
  update_max_abs_diff (weights after one update, 2 vs 1), update_tokens_per_s_ws1 / _ws2,
  logprob_peak_mb_full / _chunked (peak of live op outputs, vocabulary --vocab, TensorMemoryProbe).
Logs go to stderr.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from ..infra.config.run_config import TinyModelConfig
from ..infra.config.training import GRPOConfig, OptimizerConfig
from ..infra.config.learner import LearnerConfig
from ..infra.models import build_tiny_model
from ..rollout.batch import RolloutBatch
from .batches import from_sequences


def random_batch(samples: int, tokens: int, seed: int, vocab: int = 40) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    toks, resp = [], []
    for _ in range(samples):
        prompt = int(rng.integers(4, 9))
        r = max(1, int(rng.integers(tokens // 2, tokens)))
        toks.append(rng.integers(2, vocab, prompt + r).tolist())
        resp.append(r)
    return from_sequences(toks, resp, [[-3.0] * r for r in resp], [[0] * r for r in resp],
                          advantages=rng.normal(size=samples))


def local_state_bytes(net: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients (as large as the trainable parameters during a step) and
    optimizer state; sharded tensors count only their local shard."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in net.parameters()]
    trainable = [local(p) for p in net.parameters() if p.requires_grad]
    optim = [local(v) for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"params": size(params), "grads": size(trainable), "optimizer": size(optim)}


def _rank(rank: int, world: int, port: int, args, model_dir: str, out) -> None:
    from ..tasks.learner.actor import LearnerActor
    from ..tasks.learner.state import full_model_state

    lcfg = LearnerConfig(world_size=world, device=args.device, cpu_threads=args.threads)
    learner = LearnerActor(model_dir, GRPOConfig(micro_batch_size=args.micro_batch), OptimizerConfig(), 1.0, 0, True,
                           learner_cfg=lcfg, rank=rank, master=("127.0.0.1", port))
    batch = random_batch(args.samples, args.tokens, 0)
    old = learner.compute_logprobs(batch)
    learner.update(batch, old)
    full = full_model_state(learner.net, learner.model, learner.sharded)  # world_size 1: views of the live weights
    weights = {k: v.float().numpy().copy() for k, v in full.items()}
    state = local_state_bytes(learner.net, learner.optimizer)
    times = []
    for k in range(args.repeats):
        b = random_batch(args.samples, args.tokens, k + 1)
        start = time.perf_counter()
        learner.update(b, learner.compute_logprobs(b))
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put({"weights": weights, "state_bytes": sum(state.values()), "state": state,
                 "tokens_per_s": float(batch.seq_lengths.sum()) / float(np.median(times))})
    if learner.sharded:
        torch.distributed.destroy_process_group()


def run_world(world: int, args, model_dir: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, model_dir, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    return result


def logprob_peaks(vocab: int, rows: int, seq: int, chunk: int) -> tuple[float, float]:
    """Peak MiB of live op outputs for the logprobs of one [rows, seq] micro-batch: full logits vs chunked."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..infra.tensor_memory import TensorMemoryProbe
    from ..tasks.learner.micro_batches import make_micro_batch
    from ..tasks.learner.token_logprobs import ResponseLogprobModel

    torch.manual_seed(0)
    lm = Qwen2ForCausalLM._from_config(Qwen2Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, tie_word_embeddings=True), attn_implementation="sdpa").eval()
    mb = make_micro_batch(random_batch(rows, seq, 0, vocab), list(range(rows)), 0)
    with torch.no_grad(), TensorMemoryProbe() as full:
        logits = lm(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        picked = torch.gather(logits, 1, mb.logit_positions.unsqueeze(-1).expand(-1, -1, vocab))
        torch.gather(torch.log_softmax(picked.float(), dim=-1), -1, mb.targets.unsqueeze(-1))
        del logits
    with torch.no_grad(), TensorMemoryProbe() as chunked:
        ResponseLogprobModel(lm, 1.0, chunk)(mb.input_ids, mb.attention_mask, mb.logit_positions, mb.targets,
                                             mb.response_mask)
    return full.peak_bytes / 2**20, chunked.peak_bytes / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--hidden", type=int, default=128, help="tiny model hidden size (layers: --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the logprob memory measurement")
    ap.add_argument("--logprob-rows", type=int, default=2)
    ap.add_argument("--logprob-seq", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = TinyModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=4, num_kv_heads=2,
                               intermediate_size=2 * args.hidden)
        model_dir = str(build_tiny_model(tmp, tiny))
        one, two = run_world(1, args, model_dir), run_world(2, args, model_dir)
    diff = max(float(np.abs(one["weights"][k] - two["weights"][k]).max()) for k in one["weights"])
    print(f"state per rank ws1 {one['state']} ws2 {two['state']}", file=sys.stderr)
    full_mb, chunked_mb = logprob_peaks(args.vocab, args.logprob_rows, args.logprob_seq, args.chunk)
    print(json.dumps({
        "world_size": 2, "device": args.device, "state_bytes_ratio": round(two["state_bytes"] / one["state_bytes"], 4),
        "update_max_abs_diff": diff, "update_tokens_per_s_ws1": round(one["tokens_per_s"], 1),
        "update_tokens_per_s_ws2": round(two["tokens_per_s"], 1), "vocab": args.vocab,
        "logprob_rows_x_seq": [args.logprob_rows, args.logprob_seq], "logprob_chunk_tokens": args.chunk,
        "logprob_peak_mb_full": round(full_mb, 1), "logprob_peak_mb_chunked": round(chunked_mb, 1)}))


if __name__ == "__main__":
    main()
