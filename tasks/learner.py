"""The learner: policy and reference models in Ray actors (one class; the reference is `trainable=False`).

Both compute per-token logprobs of response tokens (log_softmax(logits / T), T = the sampler's
temperature). The policy also runs the GRPO update: PPO-clipped loss against old logprobs, an off-policy
correction against the engine's rollout logprobs (grpo.off_policy), optional KL to the reference, gradient
accumulation over micro-batches, gradient clipping, AdamW; each update bumps `weight_version` and reports
off-policy metrics (tasks/offpolicy_metrics.py).

The model stays in eval mode for the update too: dropout would make the loss's logprobs differ from
the ones computed for old/ref logprobs (and break bitwise reproducibility on resume).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from infra.config import OFF_POLICY_NEEDS_OLD_LOGPROBS, GRPOConfig, OptimizerConfig
from infra.models import load_causal_lm, load_tokenizer
from tasks.batching import MicroBatch, RolloutBatch, check_per_token, make_micro_batch, micro_batch_indices, pad_per_token
from tasks.grpo_loss import (aggregate, clipped_policy_loss, entropy_from_logits, kl_penalty, off_policy_correction,
                             token_logprobs)
from tasks.offpolicy_metrics import OffPolicyStats

__all__ = ["LearnerActor", "create_learners"]
STATE_FORMAT = 1


class LearnerActor:
    """Policy (trainable=True) or frozen reference (trainable=False) over an HF causal LM folder."""

    def __init__(self, model_path: str, grpo_cfg: GRPOConfig, optim_cfg: OptimizerConfig, temperature: float,
                 seed: int, trainable: bool, dtype: str = "float32", num_threads: int | None = 1,
                 device: str = "cpu", total_steps: int = 1):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for logprobs; got {temperature}")
        self.model_path, self.grpo, self.optim_cfg = str(model_path), grpo_cfg, optim_cfg
        self.temperature, self.trainable, self.device = float(temperature), bool(trainable), device
        self.total_steps = int(total_steps)
        self.model = load_causal_lm(self.model_path, dtype=dtype, device=device)
        self.model.eval()
        cfg = self.model.config
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(cfg, "eos_token_id", None) or 0))
        self._version = 0
        self.optimizer = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad], lr=optim_cfg.lr,
                betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay, foreach=False)
        else:
            self.model.requires_grad_(False)

    # ----- logprobs -----
    def _response_logits(self, mb: MicroBatch) -> torch.Tensor:
        """Logits at the positions predicting each response token: [B, R, V]."""
        out = self.model(input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device),
                         use_cache=False)
        logits = out.logits
        index = mb.logit_positions.to(self.device).unsqueeze(-1).expand(-1, -1, logits.size(-1))
        return torch.gather(logits, 1, index)

    def _micro_batches(self, batch: RolloutBatch, subset: list[int] | None = None):
        subset = list(range(len(batch))) if subset is None else subset
        lengths = batch.seq_lengths[subset]
        for indices in micro_batch_indices(lengths, self.grpo.micro_batch_size):
            yield make_micro_batch(batch, [subset[i] for i in indices], self.pad_id)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Logprob of every response token of the batch -> float32[Tr] (the batch's token order)."""
        out = np.zeros(len(batch.response_tokens), dtype=np.float32)
        starts = batch.response_offsets
        for mb in self._micro_batches(batch):
            logp = token_logprobs(self._response_logits(mb), mb.targets.to(self.device), self.temperature).cpu()
            for row, i in enumerate(mb.indices):
                out[starts[i]:starts[i + 1]] = logp[row, :batch.response_lengths[i]].numpy()
        return out

    # ----- update -----
    def _old_logprobs(self, batch: RolloutBatch, old_logprobs: np.ndarray | None) -> tuple[np.ndarray, str]:
        if old_logprobs is not None:
            check_per_token("old_logprobs", old_logprobs, batch)
            return old_logprobs, "given"
        if self.grpo.off_policy in OFF_POLICY_NEEDS_OLD_LOGPROBS:  # no silent fallback (every weight would be 1)
            raise ValueError(f"grpo.off_policy={self.grpo.off_policy} needs old logprobs (compute_logprobs), not None")
        # None: the caller decided the rollout logprobs stand in (tasks.logprob.needs_old_logprob_pass)
        return batch.rollout_logprobs, "rollout"

    def update(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None,
               ref_logprobs: np.ndarray | None = None) -> dict:
        """One iteration's update: grpo.num_steps_per_rollout optimizer steps, each over one mini-batch (a
        contiguous, group-aligned share of the batch; micro-batches accumulate gradients) -> metrics."""
        if not self.trainable:
            raise RuntimeError("update() called on a frozen reference learner (trainable=False)")
        started = time.perf_counter()
        g = self.grpo
        if g.kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError(f"grpo.kl_coef={g.kl_coef} needs ref_logprobs from the reference learner "
                                 "(or set grpo.kl_coef=0)")
            check_per_token("ref_logprobs", ref_logprobs, batch)
        old, old_source = self._old_logprobs(batch, old_logprobs)
        num_tokens = int(batch.loss_tokens.sum())
        stats = OffPolicyStats(g.off_policy, self._version)  # mismatch: from old, else step 0's forward pass
        kept = self._off_policy_pass(batch, old, stats, measure_mismatch=old_source != "rollout")
        sums = dict.fromkeys(("pg_loss", "kl_loss", "loss", "clipped", "tis", "kl", "entropy", "stale", "ppo_kl",
                              "tis_max"), 0.0)
        steps = g.num_steps_per_rollout
        norms, stepped = [], []
        for k, chunk in enumerate(np.array_split(np.arange(len(batch)), steps)):
            norm, did_step = self._step(batch, chunk.tolist(), old, ref_logprobs, sums, self._version * steps + k,
                                        kept, stats if old_source == "rollout" and k == 0 else None)
            norms.append(norm)
            stepped.append(did_step)
        trained_on = self._version
        self._version += 1
        tokens, trained = float(max(num_tokens, 1)), float(max(kept.sum(), 1))  # trained: what off_policy kept
        return {
            "loss": sums["loss"] / steps, "pg_loss": sums["pg_loss"] / steps, "kl_loss": sums["kl_loss"] / steps,
            "kl": sums["kl"] / trained, "clip_fraction": sums["clipped"] / trained, "grad_norm": float(np.mean(norms)),
            "tis_weight_mean": sums["tis"] / trained, "tis_weight_max": sums["tis_max"],
            "stale_token_share": sums["stale"] / tokens, "ppo_kl": sums["ppo_kl"] / trained,
            "entropy": sums["entropy"] / trained, "old_logprob_source": old_source, **stats.metrics(),
            "num_samples": len(batch), "num_tokens": num_tokens, "num_trained_tokens": int(kept.sum()),
            "stepped": all(stepped), "optimizer_steps": int(sum(stepped)),
            "trained_weight_version": trained_on, "weight_version": self._version,
            "update_s": time.perf_counter() - started, "lr": self.optimizer.param_groups[0]["lr"],
            **({"nll": -float(np.dot(old, batch.loss_mask)) / tokens} if batch.sft else {}),  # before the step
        }

    def _off_policy_pass(self, batch: RolloutBatch, old: np.ndarray, stats: OffPolicyStats,
                         measure_mismatch: bool) -> np.ndarray:
        """Per row, the loss tokens grpo.off_policy keeps (the denominators) -> float[R]; fills `stats`."""
        g, kept = self.grpo, np.zeros(len(batch))
        for mb in self._micro_batches(batch):
            old_mb = pad_per_token(old, batch, mb.indices, mb.loss_mask.size(1))
            _, keep = off_policy_correction(g.off_policy, old_mb, mb.rollout_logprobs, mb.loss_mask, g.tis_cap,
                                            g.seq_reject_low, g.seq_reject_high)
            kept[mb.indices] = keep.sum(dim=1).numpy()
            stats.add(mb.weight_versions, mb.loss_mask, old_mb, mb.rollout_logprobs, keep)
            if measure_mismatch:
                stats.add_mismatch(mb.weight_versions, mb.loss_mask, mb.rollout_logprobs, old_mb)
        return kept

    def _step(self, batch: RolloutBatch, subset: list[int], old: np.ndarray, ref_logprobs: np.ndarray | None, sums: dict,
              step: int, kept: np.ndarray, mismatch: OffPolicyStats | None = None) -> tuple[float, bool]:
        """One AdamW step over the samples `subset`; adds its metric sums to `sums` -> (grad norm, stepped).
        kept: _off_policy_pass's; mismatch: where to add the training-inference mismatch of this forward pass."""
        g = self.grpo
        total_tokens, total_seqs = float(kept[subset].sum()), float((kept[subset] > 0).sum())
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch, subset):
            logits = self._response_logits(mb)
            targets, mask = mb.targets.to(self.device), mb.loss_mask.to(self.device)
            logp = token_logprobs(logits, targets, self.temperature)
            old_mb = pad_per_token(old, batch, mb.indices, mask.size(1)).to(self.device)
            pg, clipped = clipped_policy_loss(logp, old_mb, mb.advantages.to(self.device), g.clip_eps, g.clip_eps_high)
            weights, mask = off_policy_correction(g.off_policy, old_mb, mb.rollout_logprobs.to(self.device), mask,
                                                  g.tis_cap, g.seq_reject_low, g.seq_reject_high)
            if mismatch is not None:
                mismatch.add_mismatch(mb.weight_versions, mb.loss_mask, mb.rollout_logprobs, logp.detach())
            pg_loss = aggregate(pg * weights, mask, g.loss_agg, total_tokens, total_seqs)
            loss = pg_loss
            if g.kl_coef > 0:
                ref_mb = pad_per_token(ref_logprobs, batch, mb.indices, mask.size(1)).to(self.device)
                kl = kl_penalty(logp, ref_mb, g.kl_estimator)
                kl_loss = aggregate(kl, mask, g.loss_agg, total_tokens, total_seqs)
                loss = loss + g.kl_coef * kl_loss
                sums["kl_loss"] += float(kl_loss.detach())
                sums["kl"] += float((kl.detach() * mask).sum())
            if total_tokens > 0:
                loss.backward()
            with torch.no_grad():
                sums["pg_loss"] += float(pg_loss.detach())
                sums["loss"] += float(loss.detach())
                sums["clipped"] += float((clipped * mask).sum())
                sums["tis"] += float((weights * mask).sum())
                sums["ppo_kl"] += float(((old_mb - logp.detach()) * mask).sum())
                sums["entropy"] += float((entropy_from_logits(logits.detach(), self.temperature) * mask).sum())
                policy_made = (mb.weight_versions >= 0) & (mb.weight_versions < self._version)  # -1: SFT, no policy
                sums["stale"] += float((policy_made.float() * mb.loss_mask).sum())
                if mask.sum() > 0:
                    sums["tis_max"] = max(sums["tis_max"], float(weights[mask > 0].max()))
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip)) if total_tokens else 0.0
        stepped = total_tokens > 0 and bool(np.isfinite(grad_norm))
        if stepped:
            for group in self.optimizer.param_groups:
                group["lr"] = self.optim_cfg.lr_at(step, self.total_steps * self.grpo.num_steps_per_rollout)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    # ----- weights and state -----
    def weight_version(self) -> int:
        return self._version

    def state_dict_ref(self) -> dict[str, torch.Tensor]:
        """The model's tensors (no copy here; Ray serialises them once when this returns)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_weights(self, folder: str) -> str:
        """Write an HF folder (safetensors + config + tokenizer) for /update_weights_from_disk."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        try:
            load_tokenizer(self.model_path).save_pretrained(out)
        except (OSError, ValueError):  # a model folder without a tokenizer: engines keep theirs
            pass
        (out / "spillover_weights.json").write_text(json.dumps({"weight_version": self._version}))
        return str(out)

    def _unique_state_keys(self) -> list[str]:
        """state_dict keys with tied duplicates (e.g. lm_head = embed_tokens) dropped: safetensors refuses
        shared tensors, and loading the first key fills both."""
        seen, keys = set(), []
        for key, value in self.model.state_dict().items():
            if value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                keys.append(key)
        return keys

    def get_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Model + optimizer state as named tensors (safetensors-ready) and JSON-able meta."""
        sd = self.model.state_dict()
        tensors = {f"model/{k}": sd[k].detach().cpu().clone().contiguous() for k in self._unique_state_keys()}
        meta: dict = {"format": STATE_FORMAT, "weight_version": self._version, "trainable": self.trainable,
                      "model_keys": self._unique_state_keys()}
        if self.optimizer is not None:
            opt = self.optimizer.state_dict()
            scalars: dict = {}
            for idx, state in opt["state"].items():
                for name, value in state.items():
                    if torch.is_tensor(value):
                        tensors[f"optim/{idx}/{name}"] = value.detach().cpu().clone().contiguous()
                    else:
                        scalars[f"{idx}/{name}"] = value
            meta["optimizer_param_groups"] = opt["param_groups"]
            meta["optimizer_scalars"] = scalars
        tensors["rng/torch"] = torch.get_rng_state()
        json.dumps(meta)  # fail here, not in the checkpoint writer, if something is not JSON-able
        return tensors, meta

    def set_state(self, tensors: dict, meta: dict) -> None:
        """Restore what get_state returned (tensors may be numpy arrays, e.g. from safetensors.numpy)."""
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"learner state format {meta.get('format')!r} is not {STATE_FORMAT}; "
                             "the checkpoint was written by another version")
        as_tensor = {k: torch.as_tensor(np.asarray(v)) if not torch.is_tensor(v) else v for k, v in tensors.items()}
        model_sd = {k[len("model/"):]: v for k, v in as_tensor.items() if k.startswith("model/")}
        expected = set(self._unique_state_keys())
        if set(model_sd) != expected:
            missing, extra = sorted(expected - set(model_sd))[:5], sorted(set(model_sd) - expected)[:5]
            raise ValueError(f"learner state does not fit model {self.model_path}: missing {missing}, extra {extra}")
        result = self.model.load_state_dict(model_sd, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"learner state has unexpected model keys {result.unexpected_keys[:5]}")
        if self.optimizer is not None:
            if "optimizer_param_groups" not in meta:
                raise ValueError("learner state has no optimizer state; it was saved from a frozen learner")
            state: dict = {}
            for key, value in as_tensor.items():
                if key.startswith("optim/"):
                    _, idx, name = key.split("/", 2)
                    state.setdefault(int(idx), {})[name] = value.clone()
            for key, value in meta.get("optimizer_scalars", {}).items():
                idx, name = key.split("/", 1)
                state.setdefault(int(idx), {})[name] = value
            groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g)
                      for g in meta["optimizer_param_groups"]]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if "rng/torch" in as_tensor:
            torch.set_rng_state(as_tensor["rng/torch"].to(torch.uint8).cpu())
        self._version = int(meta["weight_version"])


def create_learners(model_path, cfg, num_cpus: float = 0, num_threads: int = 1, num_gpus: float = 0):
    """Start the policy actor, and the frozen reference actor when grpo.kl_coef > 0 -> (policy, ref | None).

    `cfg` is the RunConfig; actors get only the sections they use. num_cpus stays small (0) by default:
    Ray's CPU slots are shared with the engines, and the learner waits on them most of the time.
    """
    import ray

    device = "cuda" if num_gpus else "cpu"
    actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(LearnerActor)
    common = dict(grpo_cfg=cfg.grpo, optim_cfg=cfg.optimizer, temperature=cfg.rollout.temperature,
                  total_steps=cfg.schedule.num_iterations,
                  seed=cfg.model.seed, dtype=cfg.model.dtype, num_threads=num_threads, device=device)
    policy = actor.remote(str(model_path), trainable=True, **common)
    ref = actor.remote(str(model_path), trainable=False, **common) if cfg.grpo.kl_coef > 0 else None
    return policy, ref
