"""How far the learner is from the chip (issues 12, 28, 36): a random-init Qwen2 (no download; `0.5b` and `1.5b` are
Qwen2.5-0.5B's and -1.5B's shapes) trained by spillover's own LearnerActor without Ray, with a GPU recipe's precision,
optimizer and micro-batching (model.dtype, learner.*, optimizer, grpo; default configs/gpu/qwen2.5-0.5b-math.yaml):
world_size 1, FSDP2 on CUDA (autocast on CPU), `iterations` x (old logprobs + a GRPO update) on random token batches
with long-tailed lengths (lognormal responses capped at the recipe's rollout.max_tokens, like real GRPO ones).

Modes (one JSON line each on stdout; logs on stderr): `count` = grpo.micro_batch_size padded rows (the path before
issue 36); `budget` = learner.max_tokens_per_micro_batch packed rows (the recipe's budget, or --budget);
`budget_padded` = the same token budget with padded rows.

Figures: tokens_per_s (prompt + response tokens of an iteration / its median time: compute_logprobs + update),
padding_share (positions the update's forwards computed that are padding / all it computed), peak_gpu_gb, and

    mfu = model_flops / step_s / matmul_flops_per_s
    model_flops = 8 N T + 8 V H T_resp + 8 n_layers H sum(L^2)

per iteration: one forward (old logprobs) and one forward + backward (the update, 3x a forward) = 4 forwards; a
forward is 2 N T for the N decoder parameters (embeddings and lm_head not counted) over all T tokens, 2 V H per
response token for the lm_head (the learner projects only response positions: T_resp), and 2 n_layers H L^2 of causal
attention (QK^T and AV, 4 H L^2 per layer, halved by causality) per sequence of L tokens. Recomputation
(gradient checkpointing) is not counted, as MFU never counts it. matmul_flops_per_s: this run's own dense matmul in the
compute dtype after warm-up (8192^3 on CUDA, 1024^3 on CPU), so mfu is measured against the chip it ran on.

vs_plain_torch (with --plain, the CPU default): the learner's tokens_per_s over plain torch's doing the same work in
the same run: an HF model (same weights, precision, gradient checkpointing) with a no-grad forward over the same rows
(logits -> log_softmax at the response tokens), then per optimizer step forward + backward of a policy-gradient loss and
AdamW, in padded micro-batches: `count` the learner's own, the token budgets rows sorted by length and as many per
micro-batch as fit the budget padded (what a plain loop would do with that budget: little padding, no packing).

Also (the learner_precision check of bench/gpu_smoke.py): params, dtypes of masters / AdamW state / compute / what
engines get, moved_share (share of weights the first update changed at the recipe's lr), step_s, and the KL
reference's pass in the learner (the recipe's grpo.kl_coef and learner.reference_placement, or --reference):
reference_placement, ref_logprob_s per iteration (not in step_s or mfu; offloaded: the copy back included), its
memory in peak_gpu_gb. --reference none: no KL, no reference (so too a recipe whose reference has GPUs of its own,
reference_placement=separate, or that has no KL).

    python bench/gpu_learner.py [--device cuda|cpu] [--learner-size tiny|0.5b|1.5b] [--recipe FILE]
                                [--modes count,budget] [--samples 64] [--max-response N] [--budget TOKENS] [--plain]
                                [--reference with_policy|with_policy_offloaded|none]
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
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = ROOT / "configs" / "gpu" / "qwen2.5-0.5b-math.yaml"
RECIPES = {"1.5b": ROOT / "configs" / "gpu" / "qwen2.5-1.5b-math.yaml"}  # others: DEFAULT_RECIPE
SIZES = {  # Qwen2 shapes: hidden, intermediate, layers, heads, kv heads, vocabulary
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
MODES = ("count", "budget", "budget_padded")


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def random_qwen2(size: str, folder: Path, dtype: torch.dtype = torch.float32, tokenizer: bool = False) -> Path:
    """A random-init Qwen2 of SIZES[size] saved as an HF folder in `dtype` (the recipes' checkpoints are bfloat16);
    tokenizer: also a small char-level tokenizer (servers that load one; token ids are what the checks send)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1e6)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        from ..infra.models import build_char_tokenizer

        build_char_tokenizer().save_pretrained(folder)
    return folder


def random_batch(samples: int, max_response: int, vocab: int, seed: int):
    """Long-tailed like GRPO responses: lognormal response lengths (median max_response / 6, sigma 1: ~4% reach the
    cap), prompts of 32-160 tokens."""
    from .batches import from_sequences

    rng = np.random.default_rng(seed)
    responses = np.clip(rng.lognormal(np.log(max(max_response / 6, 1.0)), 1.0, samples), 1, max_response).astype(int)
    seqs = [rng.integers(2, vocab, int(rng.integers(32, 161)) + int(r)).tolist() for r in responses]
    lengths = responses.tolist()
    return from_sequences(seqs, lengths, [[-3.0] * n for n in lengths], [[0] * n for n in lengths],
                          advantages=rng.normal(size=samples))


def recipe_settings(recipe: str | Path, device: str, mode: str = "budget", budget: int | None = None,
                    reference: str | None = None):
    """A recipe's (model.dtype, learner section at world_size 1 on `device` micro-batched by `mode`, grpo, optimizer,
    rollout.max_tokens). reference: where the learner holds the KL reference (default: the recipe's
    learner.reference_placement); "none", a reference of its own or a recipe without KL (grpo.kl_coef 0): no KL."""
    from ..infra.config.run_config import load_config

    cfg = load_config(recipe)
    tokens = None if mode == "count" else (budget or cfg.learner.max_tokens_per_micro_batch or 16384)
    placement = reference or cfg.learner.reference_placement
    held = placement in ("with_policy", "with_policy_offloaded") and cfg.grpo.kl_coef > 0
    lcfg = cfg.learner.model_copy(update={"world_size": 1, "device": device, "max_tokens_per_micro_batch": tokens,
                                          "pack_sequences": mode == "budget",
                                          "reference_placement": placement if held else "separate"})
    grpo = cfg.grpo if held else cfg.grpo.model_copy(update={"kl_coef": 0.0})
    return cfg.model.dtype, lcfg, grpo, cfg.optimizer, cfg.rollout.max_tokens


def matmul_flops_per_s(device: str, dtype: torch.dtype) -> float:
    """This device's dense matmul rate in `dtype` (FLOP/s): n^3 after warm-up, n = 8192 on CUDA, 1024 on CPU."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    reps = 20 if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.synchronize()
    tic = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - tic)


def model_flops(shape: dict, decoder_params: int, batch) -> float:
    """The module docstring's model_flops of one iteration (old logprobs + update) over `batch`."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    seq = batch.seq_lengths.astype(np.float64)
    return (8 * decoder_params * seq.sum() + 8 * shape["vocab_size"] * hidden * batch.response_lengths.sum()
            + 8 * layers * hidden * float((seq ** 2).sum()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def learner_smoke(size: str, device: str, iterations: int = 3, samples: int = 64, tokens: int | None = None,
                  recipe: str | Path = DEFAULT_RECIPE, mode: str = "budget", budget: int | None = None,
                  plain: bool = False, peak_flops: float | None = None, reference: str | None = None) -> dict:
    """One mode's figures (the module docstring). tokens: the response cap (default: the recipe's rollout.max_tokens);
    peak_flops: the matmul rate to measure mfu against (default: measured here); reference: recipe_settings'."""
    from ..tasks.learner.actor import LearnerActor
    from ..tasks.learner.distributed import DTYPES

    cuda = device == "cuda"
    model_dtype, lcfg, grpo, optim, max_tokens = recipe_settings(recipe, device, mode, budget, reference)
    tokens = tokens or max_tokens
    peak_flops = peak_flops or matmul_flops_per_s(device, DTYPES[lcfg.param_dtype])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_qwen2(size, Path(tmp) / size, getattr(torch, model_dtype))
        learner = LearnerActor(str(model_dir), grpo, optim, 1.0, 0, True, dtype=model_dtype, learner_cfg=lcfg,
                               master=("127.0.0.1", _free_port()), total_steps=iterations)
        baseline = PlainTorch(model_dir, lcfg, grpo, optim, device) if plain else None
    compute: set[str] = set()
    learner.model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: compute.add(str(out.dtype).removeprefix("torch.")))
    params = sum(p.numel() for p in learner.model.parameters())
    decoder_params = sum(p.numel() for p in learner.model.get_decoder().layers.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = [_local(p).detach().clone() for p in learner.model.parameters()]
    step_s, plain_s, flops, tokens_per_step, moved, padding, ref_s = [], [], [], 0, 0, [], []
    for k in range(iterations):
        batch = random_batch(samples, tokens, SIZES[size]["vocab_size"], k)
        tokens_per_step = int(batch.seq_lengths.sum())
        ref = None
        if learner.reference is not None:
            _sync(device)
            tic = time.perf_counter()
            ref = learner.compute_ref_logprobs(batch)
            ref_s.append(round(time.perf_counter() - tic, 3))  # its result on the host: the device is done
        _sync(device)
        tic = time.perf_counter()
        metrics = learner.update(batch, learner.compute_logprobs(batch), ref)
        _sync(device)
        step_s.append(round(time.perf_counter() - tic, 3))
        padding.append(metrics["padding_share"])
        flops.append(model_flops(SIZES[size], decoder_params, batch))
        if k == 0:
            moved = sum(int((_local(p).detach() != b).sum()) for p, b in zip(learner.model.parameters(), before))
            del before
        if baseline is not None:
            plain_s.append(baseline.iteration(batch))
        log(f"{size} {mode} iteration {k}: {tokens_per_step} tokens, {step_s[-1]} s"
            + (f" (plain torch {plain_s[-1]:.3f} s)" if plain_s else ""))
    median = float(np.median(step_s))
    dtypes = lambda ts: sorted({str(t.dtype).removeprefix("torch.") for t in ts})  # noqa: E731
    out = {"size": size, "mode": mode, "recipe": Path(recipe).name, "params": int(params), "device": device,
           "model_dtype": model_dtype, "param_dtype": lcfg.param_dtype, "reduce_dtype": lcfg.reduce_dtype,
           "max_tokens_per_micro_batch": lcfg.max_tokens_per_micro_batch, "pack_sequences": lcfg.packs_sequences,
           "micro_batch_size": grpo.micro_batch_size, "gradient_checkpointing": lcfg.gradient_checkpointing,
           "lr": optim.lr, "master_dtypes": dtypes(learner.model.parameters()),
           "optimizer_state_dtypes": dtypes(v for s in learner.optimizer.state.values() for n, v in s.items()
                                            if n != "step"),
           "compute_dtypes": sorted(compute), "sent_dtypes": sorted({d for _, d, _ in learner.weight_specs()}),
           "moved_share": round(moved / params, 4), "tokens_per_step": tokens_per_step, "step_s": step_s,
           "tokens_per_s": round(tokens_per_step / median, 1),
           "update_tokens_per_s": round(tokens_per_step / median, 1),  # the name gpu_smoke's readers know
           "padding_share": round(float(np.mean(padding)), 4),
           "mfu": round(float(np.median(np.asarray(flops) / np.asarray(step_s))) / peak_flops, 4),
           "matmul_tflops": round(peak_flops / 1e12, 2),
           "reference_placement": lcfg.reference_placement if learner.reference is not None else "none",
           "ref_logprob_s": ref_s,
           "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0}
    if plain_s:
        out["plain_tokens_per_s"] = round(tokens_per_step / float(np.median(plain_s)), 1)
        out["vs_plain_torch"] = round(float(np.median(plain_s)) / median, 3)
    if learner.sharded:
        torch.distributed.destroy_process_group()
    return out


class PlainTorch:
    """The same work without spillover (vs_plain_torch): an HF model of the same weights, the learner's precision
    (autocast) and gradient checkpointing, AdamW (fused on CUDA); padded rows, full logits."""

    def __init__(self, model_dir: Path, lcfg, grpo, optim, device: str):
        from transformers import AutoModelForCausalLM

        from ..tasks.learner.distributed import DTYPES

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.to(device)
        if lcfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()  # HF checkpoints only in train mode; Qwen2 has no dropout, so the math is eval's
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, fused=device == "cuda")
        self.dtype, self.device, self.grpo, self.lcfg = DTYPES[lcfg.param_dtype], device, grpo, lcfg

    def _logprobs(self, batch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded rows -> (logprob of each next token [B, L-1], response mask [B, L-1], advantages [B, 1])."""
        from .batches import row_sequence

        seqs = [row_sequence(batch, i) for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        resp = torch.zeros(len(rows), width - 1)
        for b, (i, s) in enumerate(zip(rows, seqs)):
            ids[b, :len(s)], mask[b, :len(s)] = torch.from_numpy(s), 1
            resp[b, len(s) - 1 - batch.response_lengths[i]:len(s) - 1] = 1
        ids, mask, resp = ids.to(self.device), mask.to(self.device), resp.to(self.device)
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return logp, resp, torch.as_tensor(batch.advantages[rows], device=self.device).float().unsqueeze(1)

    def iteration(self, batch) -> float:
        """Seconds for old logprobs + the update's optimizer steps over the micro-batches the learner cuts."""
        _sync(self.device)
        tic = time.perf_counter()
        with torch.no_grad():
            old = [self._logprobs(batch, rows)[0] for rows in _cuts(batch, self.lcfg, self.grpo, None)]
            torch.cat([o.flatten() for o in old]).cpu()
        for chunk in np.array_split(np.arange(len(batch)), self.grpo.num_steps_per_rollout):
            total = float(batch.response_lengths[chunk].sum())
            for rows in _cuts(batch, self.lcfg, self.grpo, chunk.tolist()):
                logp, resp, adv = self._logprobs(batch, rows)
                (-(logp * adv * resp).sum() / total).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - tic


def _cuts(batch, lcfg, grpo, subset: list[int] | None) -> list[list[int]]:
    """Plain torch's micro-batches of `subset`: grpo.micro_batch_size rows of similar lengths (the learner's own cut)
    without a token budget; with one, rows by length, each micro-batch as many as fit the budget padded (B x the
    longest <= budget): the few-padding cut a plain torch loop would take for the same budget."""
    from ..tasks.learner.micro_batches import micro_batch_indices

    rows = list(range(len(batch))) if subset is None else subset
    lengths = batch.seq_lengths[rows]
    budget = lcfg.max_tokens_per_micro_batch
    if budget is None:
        return [[rows[i] for i in mb] for mb in micro_batch_indices(lengths, grpo.micro_batch_size)]
    cut: list[list[int]] = [[]]
    for i in np.argsort(lengths, kind="stable").tolist():  # ascending: the newest row is the longest
        if cut[-1] and (len(cut[-1]) + 1) * int(lengths[i]) > budget:
            cut.append([])
        cut[-1].append(rows[i])
    return cut


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--learner-size", choices=sorted(SIZES), default=None,
                        help="default: 0.5b on CUDA, tiny on CPU")
    parser.add_argument("--recipe", default=None, help="default: the size's math recipe under configs/gpu/")
    parser.add_argument("--modes", default="count,budget", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--samples", type=int, default=None, help="rows per iteration (default: 256 CUDA, 64 CPU)")
    parser.add_argument("--max-response", type=int, default=None, help="response cap (default: the recipe's)")
    parser.add_argument("--budget", type=int, default=None, help="tokens per micro-batch (default: the recipe's)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction, default=None,
                        help="also time plain torch for vs_plain_torch (default: on CPU only)")
    parser.add_argument("--reference", choices=["with_policy", "with_policy_offloaded", "none"], default=None,
                        help="the KL reference in the learner (default: the recipe's learner.reference_placement)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; the modes are {list(MODES)}")
    cuda = args.device == "cuda"
    size = args.learner_size or ("0.5b" if cuda else "tiny")
    recipe = args.recipe or RECIPES.get(size, DEFAULT_RECIPE)
    from ..tasks.learner.distributed import DTYPES

    peak = matmul_flops_per_s(args.device, DTYPES[recipe_settings(recipe, args.device)[1].param_dtype])
    results = []
    for mode in modes:
        out = learner_smoke(size, args.device, args.iterations, args.samples or (256 if cuda else 64),
                            args.max_response, recipe, mode, args.budget,
                            plain=not cuda if args.plain is None else args.plain, peak_flops=peak,
                            reference=args.reference)
        print(json.dumps(out), flush=True)
        results.append(out)
        if cuda:
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
