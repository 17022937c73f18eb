"""Does the learner's loss drive reward up? GRPO on the built-in "a*n=" task, no engines, no Ray.

Each iteration samples `--prompts` prompts x `--n` responses with HF `generate` (temperature 1, no
top-k/top-p), scores them with spillover.rollout.builtin.toy_task.reward, and runs one LearnerActor.update (in-process).
`--lag K` samples with the weights of K updates ago, a stand-in for partial rollout's stale tokens:
old logprobs then come from the learner and TIS corrects towards them.

Prints one JSON line (the curve and summary) on stdout; progress goes to stderr.
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import collections
import copy
import json
import sys
import tempfile
import time

import numpy as np
import torch

from ..infra.config.run_config import TinyModelConfig
from ..infra.config.training import GRPOConfig, OptimizerConfig
from ..infra.models import build_tiny_model, load_tokenizer
from ..rollout.builtin import toy_task
from .batches import from_sequences
from ..tasks.grpo_loss import group_advantages
from ..tasks.learner.actor import LearnerActor


def sample_responses(model, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                     pad_id: int, eos_id: int) -> tuple[list[list[int]], list[list[float]]]:
    """n sampled responses per prompt (EOS kept, as SGLang returns it) and their logprobs."""
    rows = [p for p in prompt_ids for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=max_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
                             return_dict_in_generate=True, output_logits=True)
    new = out.sequences[:, width:]
    logp = torch.log_softmax(torch.stack(out.logits, dim=1).float() / temperature, dim=-1)
    token_logp = torch.gather(logp, -1, new.unsqueeze(-1)).squeeze(-1)
    responses, logprobs = [], []
    for row in range(new.size(0)):
        toks = new[row].tolist()
        end = toks.index(eos_id) + 1 if eos_id in toks else len(toks)
        responses.append(toks[:end])
        logprobs.append(token_logp[row, :end].tolist())
    return responses, logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lag", type=int, default=0, help="sample with the weights of K updates ago")
    ap.add_argument("--no-tis", action="store_true")
    ap.add_argument("--loss-agg", default="token_mean", choices=["token_mean", "seq_mean"])
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show-every", type=int, default=0, help="print a few responses every K iterations")
    args = ap.parse_args()

    started = time.perf_counter()
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="learn_sanity_"), TinyModelConfig(), seed=args.seed)
    tok = load_tokenizer(model_dir)
    learner = LearnerActor(str(model_dir), GRPOConfig(micro_batch_size=args.micro_batch, off_policy="none" if args.no_tis else "tis",
                                                      loss_agg=args.loss_agg),
                           OptimizerConfig(lr=args.lr), temperature=1.0, seed=args.seed, trainable=True,
                           num_threads=args.threads)
    sampler = copy.deepcopy(learner.model) if args.lag else learner.model
    past = collections.deque([copy.deepcopy(learner.model.state_dict())], maxlen=args.lag + 1)
    labels = toy_task.draw_targets(4096, args.seed)
    baseline_answer, baseline = toy_task.prompt_independent_baseline(labels)
    rng = np.random.default_rng(args.seed)
    curve, exact, lengths, update_s = [], [], [], []
    for it in range(args.iterations):
        picked = rng.choice(len(labels), size=args.prompts, replace=False)
        prompt_ids = [tok(toy_task.make_prompt(int(labels[i])))["input_ids"] for i in picked]
        if args.lag:
            sampler.load_state_dict(past[0])
        responses, rollout_lp = sample_responses(sampler, prompt_ids, args.n, args.max_tokens, 1.0,
                                                 tok.pad_token_id, tok.eos_token_id)
        version = learner.weight_version() - (len(past) - 1 if args.lag else 0)
        texts = [tok.decode([t for t in r if t != tok.eos_token_id]) for r in responses]
        row_labels = [int(labels[i]) for i in picked for _ in range(args.n)]
        rewards = np.array([toy_task.reward(t, lab) for t, lab in zip(texts, row_labels)])
        adv = group_advantages(rewards.reshape(args.prompts, args.n))
        tokens = [p + r for p, r in zip([p for p in prompt_ids for _ in range(args.n)], responses)]
        batch = from_sequences(tokens, [len(r) for r in responses], rollout_lp,
                               [[version] * len(r) for r in responses], advantages=adv.reshape(-1), n=args.n)
        metrics = learner.update(batch)
        past.append(copy.deepcopy(learner.model.state_dict()))
        curve.append(float(rewards.mean()))
        exact.append(float(np.mean([toy_task.exact_match(t, lab) for t, lab in zip(texts, row_labels)])))
        lengths.append(float(np.mean([len(r) for r in responses])))
        update_s.append(metrics["update_s"])
        print(f"it {it:3d} reward {curve[-1]:.3f} exact {exact[-1]:.3f} len {lengths[-1]:5.1f} "
              f"loss {metrics['loss']:+.4f} tis {metrics['tis_weight_mean']:.3f}/{metrics['tis_weight_max']:.2f} "
              f"stale {metrics['stale_token_share']:.2f} old {metrics['old_logprob_source']} "
              f"ent {metrics['entropy']:.2f}", file=sys.stderr)
        if args.show_every and it % args.show_every == 0:
            shown = [f"{toy_task.make_prompt(lab)}{t!r}" for t, lab in zip(texts[::args.n], row_labels[::args.n])]
            print("   ", " ".join(shown[:8]), file=sys.stderr)
    fifth = max(1, args.iterations // 5)
    print(json.dumps({
        "config": vars(args), "reward_first": curve[0], "reward_first5_mean": float(np.mean(curve[:5])),
        "reward_last_fifth_mean": float(np.mean(curve[-fifth:])), "exact_last_fifth_mean": float(np.mean(exact[-fifth:])),
        "prompt_independent_baseline": baseline, "baseline_answer_len": len(baseline_answer),
        "update_s_mean": float(np.mean(update_s)), "wall_s": time.perf_counter() - started,
        "reward_curve": [round(r, 3) for r in curve], "exact_curve": [round(e, 3) for e in exact],
        "mean_length_curve": [round(x, 1) for x in lengths],
    }))


if __name__ == "__main__":
    main()
