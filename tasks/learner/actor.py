"""The learner: policy and reference models in Ray actors (one class; a reference group of its own is
`trainable=False`; learner.reference_placement=with_policy puts the reference inside the policy's ranks instead:
tasks/learner/reference.py).

Both compute per-token logprobs of response tokens (log_softmax(logits / T), T = the sampler's
temperature), projecting only response positions to the vocabulary, in chunks (tasks/learner/token_logprobs.py). The policy
also runs the GRPO update: PPO-clipped loss against old logprobs, an off-policy correction against the engine's
rollout logprobs (grpo.off_policy), optional KL to the reference, gradient accumulation over micro-batches,
gradient clipping, AdamW; each update bumps `weight_version` and reports off-policy metrics
(tasks/learner/offpolicy_metrics.py).

One actor is one rank of a learner group (tasks/learner/group.py). With learner.world_size > 1 (or on CUDA) the
model is sharded with FSDP2 and each rank trains on a token-balanced share of every mini-batch with global loss
denominators (tasks/learner/distributed.py); results and metrics are the same on every rank.

Precision: float32 parameters and AdamW state, compute in learner.param_dtype, weights to engines in model.dtype
(`dtype`), on every path (tasks/learner/distributed.py).

The model stays in eval mode for the update too: dropout would make the loss's logprobs differ from
the ones computed for old/ref logprobs (and break bitwise reproducibility on resume).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import numpy as np
import torch

from ...infra.config.training import OFF_POLICY_NEEDS_OLD_LOGPROBS, DecaySpan, GRPOConfig, OptimizerConfig
from ...infra.config.learner import LearnerConfig
from ...rollout.batch import RolloutBatch
from .micro_batches import MicroBatch, check_per_token, make_micro_batch, micro_batch_indices, pad_per_token
from .token_budget import token_budget_micro_batches
from ..grpo_loss import aggregate, clipped_policy_loss, kl_penalty, off_policy_correction
from .kl_control import next_kl_coef
from .distributed import (all_reduce, balanced_shards, compute_precision, init_distributed, load_learner_lm,
                          logprob_net)
from .state import (STATE_FORMAT, full_model_state, load_state, save_hf_folder, save_state,
                    unique_state_keys)
from .engine_host import EngineHost
from .reference import ReferenceModel
from .offpolicy_metrics import OffPolicyStats
from .weight_sender import WeightSender, for_engines, free_address

__all__ = ["LearnerActor"]
DEVICE_SUMS = ("pg_loss", "kl_loss", "loss", "clipped", "tis", "kl", "entropy", "ppo_kl")  # summed on the device


class LearnerActor:
    """Policy (trainable=True) or frozen reference (trainable=False) over an HF causal LM folder; one rank. Its weights
    go to engines through `weight_sender` (tasks/learner/weight_sender.py); a rank that hosts a colocated engine holds
    it in `engine_host` (tasks/learner/engine_host.py). dtype: model.dtype, the dtype of the weights engines get; the
    learner's own parameters are float32."""

    def __init__(self, model_path: str, grpo_cfg: GRPOConfig, optim_cfg: OptimizerConfig, temperature: float,
                 seed: int, trainable: bool, dtype: str = "float32", num_threads: int | None = 1,
                 device: str | None = None, total_steps: int = 1, learner_cfg: LearnerConfig | None = None,
                 rank: int = 0, master: tuple[str, int] | None = None):
        lcfg = learner_cfg or LearnerConfig(device=device or "cpu", cpu_threads=num_threads or 1)
        torch.set_num_threads(lcfg.cpu_threads if learner_cfg is not None else (num_threads or torch.get_num_threads()))
        torch.manual_seed(seed)
        # learner.deterministic: the CPU runs' bit-exact resume; on CUDA it selects slow kernels (the GPU recipes: off)
        torch.use_deterministic_algorithms(lcfg.deterministic, warn_only=True)
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for logprobs; got {temperature}")
        self.model_path, self.grpo, self.optim_cfg, self.lcfg = str(model_path), grpo_cfg, optim_cfg, lcfg
        self.temperature, self.trainable = float(temperature), bool(trainable)
        self.rank, self.world_size, self.total_steps = int(rank), lcfg.world_size, int(total_steps)
        self.sharded = lcfg.world_size > 1 or lcfg.device == "cuda"
        self.device = "cuda" if lcfg.device == "cuda" else "cpu"
        if self.sharded:
            if master is None:
                raise ValueError("a sharded learner rank needs master=(address, port) of rank 0")
            init_distributed(self.rank, lcfg.world_size, master[0], master[1], lcfg.backend)
        self.weight_dtype = getattr(torch, dtype)
        lm = load_learner_lm(self.model_path, lcfg)
        self.state_keys = unique_state_keys(lm)
        self.param_names = [name for name, _ in lm.named_parameters()]
        self.model, self.net = lm, logprob_net(lm, lcfg, temperature, self.sharded, self.device, trainable)  # FSDP root
        # the KL reference in this rank (learner.reference_placement=with_policy[_offloaded]): the initial model
        self.reference = (ReferenceModel(self.model_path, lcfg, temperature, self.sharded, self.device)
                          if trainable and grpo_cfg.kl_coef > 0 and lcfg.reference_with_policy else None)
        cfg = lm.config
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(cfg, "eos_token_id", None) or 0))
        self.weight_sender = WeightSender(lm, self.state_keys, self.rank, self.weight_dtype, self.device)
        self.engine_host: EngineHost | None = None  # set by host_engine (placement.colocate)
        self._version, self.kl_coef = 0, float(grpo_cfg.kl_coef)  # grpo.kl_ctrl=adaptive moves kl_coef
        # the run's lr decay: a resumed run's comes from its checkpoint (set_state), so that a longer run goes on
        # from the lr it reached instead of starting the decay over
        self.lr_decay = optim_cfg.fresh_decay(self.total_steps * grpo_cfg.num_steps_per_rollout)
        self.optimizer = None
        if trainable:  # CUDA: one fused kernel for all parameters; CPU: the per-parameter loop, as the resume tests ran
            kernel = {"fused": True} if self.device == "cuda" else {"foreach": False}
            self.optimizer = torch.optim.AdamW(
                list(self.net.parameters()), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                weight_decay=optim_cfg.weight_decay, **kernel)

    # ----- logprobs -----
    def _forward(self, net: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs[B, R], entropy[B, R]) of the micro-batch's response tokens (padded or packed) under net (the
        policy's or the reference's), float32."""
        d = self.device
        packed = {} if mb.cu_seqlens is None else dict(position_ids=mb.position_ids.to(d),
                                                       cu_seqlens=mb.cu_seqlens.to(d), max_seqlen=mb.max_seqlen)
        mask = None if mb.attention_mask is None else mb.attention_mask.to(d)
        with compute_precision(self.lcfg, self.sharded, d):
            return net(mb.input_ids.to(d), mask, mb.logit_positions.to(d), mb.targets.to(d),
                       mb.response_mask.to(d), with_entropy=with_entropy, **packed)

    def _micro_batches(self, batch: RolloutBatch, subset: list[int] | None = None, all_rows: bool = False):
        """This rank's micro-batches of `subset` (all rows when None). Sharded: a token-balanced share, and the
        same number of micro-batches on every rank (FSDP's collectives); a rank short of one gets a padding
        micro-batch with no loss tokens and no indices. all_rows: every row, on every rank (no model calls).
        learner.max_tokens_per_micro_batch: micro-batches by tokens (tasks/learner/token_budget.py), packed rows
        when learner.pack_sequences; else grpo.micro_batch_size padded rows each."""
        subset = list(range(len(batch))) if subset is None else list(subset)
        budget = self.lcfg.max_tokens_per_micro_batch
        if budget is not None and not all_rows:
            packed = self.lcfg.pack_sequences
            shortest = min(subset, key=lambda i: (int(batch.seq_lengths[i]), i))  # the cheapest padding micro-batch
            for rows in token_budget_micro_batches(batch.seq_lengths[subset], self.world_size, budget)[self.rank]:
                if rows:
                    yield make_micro_batch(batch, [subset[i] for i in rows], self.pad_id, packed)
                else:
                    mb = make_micro_batch(batch, [shortest], self.pad_id, packed)
                    yield replace(mb, indices=[], loss_mask=torch.zeros_like(mb.loss_mask))
            return
        size = self.grpo.micro_batch_size
        if all_rows or self.world_size == 1:
            shares, mine = [subset], subset
        else:
            shares = [[subset[i] for i in share]
                      for share in balanced_shards(batch.seq_lengths[subset], self.world_size)]
            mine = shares[self.rank]
        groups = micro_batch_indices(batch.seq_lengths[mine], size) if mine else []
        for indices in groups:
            yield make_micro_batch(batch, [mine[i] for i in indices], self.pad_id)
        for _ in range(max(math.ceil(len(s) / size) for s in shares) - len(groups)):
            mb = make_micro_batch(batch, [subset[0]], self.pad_id)
            yield replace(mb, indices=[], loss_mask=torch.zeros_like(mb.loss_mask))

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Logprob of every response token of the batch -> float32[Tr] (the batch's token order)."""
        self._note("compute_logprobs")
        return self._logprobs(self.net, batch)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """The KL reference's logprobs of the batch, from the frozen initial model this policy rank holds
        (learner.reference_placement=with_policy or with_policy_offloaded) -> float32[Tr]."""
        if self.reference is None:
            raise RuntimeError("compute_ref_logprobs: this learner holds no reference; a policy learner holds one "
                               "with grpo.kl_coef > 0 and learner.reference_placement=with_policy or "
                               "with_policy_offloaded")
        self._note("compute_ref_logprobs")
        with self.reference.in_use() as net:
            return self._logprobs(net, batch)

    def _logprobs(self, net: torch.nn.Module, batch: RolloutBatch) -> np.ndarray:
        out = np.zeros(len(batch.response_tokens), dtype=np.float32)
        starts = batch.response_offsets
        done = [(mb.indices, self._forward(net, mb)[0]) for mb in self._micro_batches(batch)]
        flat = torch.cat([logp.flatten() for _, logp in done]).cpu().numpy() if done else np.zeros(0, np.float32)
        at = 0  # one device-to-host copy for the batch, not a host sync per micro-batch
        for indices, logp in done:
            block = flat[at:at + logp.numel()].reshape(logp.shape)
            at += logp.numel()
            for row, i in enumerate(indices):
                out[starts[i]:starts[i + 1]] = block[row, :batch.response_lengths[i]]
        if self.world_size > 1:  # disjoint shares, zeros elsewhere: the sum is exact
            out = all_reduce(out).astype(np.float32)
        return out

    # ----- update -----
    def _old_logprobs(self, batch: RolloutBatch, old_logprobs: np.ndarray | None) -> tuple[np.ndarray, str]:
        if old_logprobs is not None:
            check_per_token("old_logprobs", old_logprobs, batch)
            return old_logprobs, "given"
        if self.grpo.off_policy in OFF_POLICY_NEEDS_OLD_LOGPROBS:  # no silent fallback (every weight would be 1)
            raise ValueError(f"grpo.off_policy={self.grpo.off_policy} needs old logprobs (compute_logprobs), not None")
        # None: the caller decided the rollout logprobs stand in (spillover.tasks.logprob.needs_old_logprob_pass)
        return batch.rollout_logprobs, "rollout"

    def update(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None,
               ref_logprobs: np.ndarray | None = None) -> dict:
        """One iteration's update: grpo.num_steps_per_rollout optimizer steps, each over one mini-batch (a
        contiguous, group-aligned share of the batch; micro-batches accumulate gradients) -> metrics."""
        if not self.trainable:
            raise RuntimeError("update() called on a frozen reference learner (trainable=False)")
        started = time.perf_counter()
        self._note("update")
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
                              "computed_positions", "real_positions", "tis_max"), 0.0)
        steps = g.num_steps_per_rollout
        norms, stepped = [], []
        for k, chunk in enumerate(np.array_split(np.arange(len(batch)), steps)):
            norm, did_step = self._step(batch, chunk.tolist(), old, ref_logprobs, sums, self._version * steps + k,
                                        kept, stats if old_source == "rollout" and k == 0 else None)
            norms.append(norm)
            stepped.append(did_step)
        if self.world_size > 1:  # each rank trained on its share: metric sums over ranks
            names = [k for k in sums if k != "tis_max"]
            # the mismatch from step 0's forward covers this rank's rows; from `old`, every rank measured every row
            own_rows = old_source == "rollout"
            total = all_reduce([sums[k] for k in names] + ([stats.mismatch_sum, stats.mismatch_n] if own_rows else []))
            sums.update(zip(names, total[:len(names)].tolist()))
            if own_rows:
                stats.mismatch_sum, stats.mismatch_n = float(total[-2]), int(total[-1])
            sums["tis_max"] = float(all_reduce([sums["tis_max"]], op="max")[0])
        trained_on = self._version
        self._version += 1
        tokens, trained = float(max(num_tokens, 1)), float(max(kept.sum(), 1))  # trained: what off_policy kept
        return {
            "loss": sums["loss"] / steps, "pg_loss": sums["pg_loss"] / steps, "kl_loss": sums["kl_loss"] / steps,
            "kl": sums["kl"] / trained, "clip_fraction": sums["clipped"] / trained, "grad_norm": float(np.mean(norms)),
            "tis_weight_mean": sums["tis"] / trained, "tis_weight_max": sums["tis_max"],
            "stale_token_share": sums["stale"] / tokens, "ppo_kl": sums["ppo_kl"] / trained,
            "entropy": sums["entropy"] / trained, "old_logprob_source": old_source, **stats.metrics(),
            "padding_share": 1.0 - sums["real_positions"] / max(sums["computed_positions"], 1.0),
            "num_samples": len(batch), "num_tokens": num_tokens, "num_trained_tokens": int(kept.sum()),
            "stepped": all(stepped), "optimizer_steps": int(sum(stepped)),
            "trained_weight_version": trained_on, "weight_version": self._version,
            "update_s": time.perf_counter() - started, "lr": self.optimizer.param_groups[0]["lr"],
            **self._advance_kl_coef(sums["kl"] / trained, len(batch)),
            **({"nll": -float(np.dot(old, batch.loss_mask)) / tokens} if batch.sft else {}),  # before the step
        }

    def _off_policy_pass(self, batch: RolloutBatch, old: np.ndarray, stats: OffPolicyStats,
                         measure_mismatch: bool) -> np.ndarray:
        """Per row, the loss tokens grpo.off_policy keeps (the denominators) -> float[R]; fills `stats`."""
        g, kept = self.grpo, np.zeros(len(batch))
        for mb in self._micro_batches(batch, all_rows=True):  # no model calls: every rank sees every row
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
        # metric sums stay on the device and are read once per step (a float() per micro-batch would wait for the
        # GPU each time); float64 from the running sums on, so the totals equal adding float() after float()
        acc = torch.tensor([sums[k] for k in DEVICE_SUMS], dtype=torch.float64, device=self.device)
        tis_max = torch.tensor(-math.inf, device=self.device)
        for mb in self._micro_batches(batch, subset):
            logp, entropy = self._forward(self.net, mb, with_entropy=True)
            mask = mb.loss_mask.to(self.device)
            old_mb = pad_per_token(old, batch, mb.indices, mask.size(1)).to(self.device)
            pg, clipped = clipped_policy_loss(logp, old_mb, mb.advantages.to(self.device), g.clip_eps, g.clip_eps_high)
            weights, mask = off_policy_correction(g.off_policy, old_mb, mb.rollout_logprobs.to(self.device), mask,
                                                  g.tis_cap, g.seq_reject_low, g.seq_reject_high)
            if mismatch is not None:
                mismatch.add_mismatch(mb.weight_versions, mb.loss_mask, mb.rollout_logprobs, logp.detach())
            pg_loss = aggregate(pg * weights, mask, g.loss_agg, total_tokens, total_seqs)
            loss, kl_loss, kl_sum = pg_loss, logp.new_zeros(()), logp.new_zeros(())
            if g.kl_coef > 0:
                ref_mb = pad_per_token(ref_logprobs, batch, mb.indices, mask.size(1)).to(self.device)
                kl = kl_penalty(logp, ref_mb, g.kl_estimator)
                kl_loss = aggregate(kl, mask, g.loss_agg, total_tokens, total_seqs)
                loss = loss + self.kl_coef * kl_loss
                kl_sum = (kl.detach() * mask).sum()
            if total_tokens > 0:
                loss.backward()
            with torch.no_grad():  # in DEVICE_SUMS order
                acc += torch.stack([pg_loss, kl_loss, loss, (clipped * mask).sum(), (weights * mask).sum(), kl_sum,
                                    (entropy * mask).sum(), ((old_mb - logp) * mask).sum()]).detach().double()
                # a padding micro-batch's weights are empty ([0, R]): the running max keeps the max defined
                tis_max = torch.cat([tis_max.view(1), torch.where(mask > 0, weights, -math.inf).flatten()]).max()
            policy_made = (mb.weight_versions >= 0) & (mb.weight_versions < self._version)  # -1: SFT, no policy
            sums["stale"] += float((policy_made.float() * mb.loss_mask).sum())  # host tensors: no device sync
            sums["computed_positions"] += mb.computed_positions
            sums["real_positions"] += float(batch.seq_lengths[mb.indices].sum())
        sums.update(zip(DEVICE_SUMS, acc.tolist()))
        sums["tis_max"] = max(sums["tis_max"], float(tis_max))  # -inf (no loss token) leaves it
        params = [p for p in self.net.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip)) if total_tokens else 0.0
        stepped = total_tokens > 0 and bool(np.isfinite(grad_norm))
        if stepped:
            for group in self.optimizer.param_groups:
                group["lr"] = self.optim_cfg.lr_at(step, self.lr_decay)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    # ----- weights and state -----
    def weight_version(self) -> int:
        return self._version

    def state_dict_ref(self) -> dict[str, torch.Tensor]:
        """The model's HF-named tensors in model.dtype, as engines load them (sharded: gathered, on rank 0 only;
        Ray serialises them once)."""
        return {k: for_engines(v, self.weight_dtype) for k, v in full_model_state(self.net, self.model,
                                                                                    self.sharded).items()}

    def state_dict_refs(self) -> dict:
        """The same tensors, each in its own object on the host (rank 0; the other ranks take part in the gather and
        return {}): the tensor sync's engine actors fetch them bucket by bucket, so none holds the whole model, and a
        learner's CUDA tensor never reaches an engine actor (unpickling it there would open a CUDA context)."""
        import ray

        return {name: ray.put(tensor.cpu()) for name, tensor in self.state_dict_ref().items()}

    def save_weights(self, folder: str) -> str:
        """Write an HF folder (safetensors + config + tokenizer, model.dtype) for /update_weights_from_disk (rank 0
        writes)."""
        state = full_model_state(self.net, self.model, self.sharded)
        if self.rank == 0:
            save_hf_folder(self.model, {k: for_engines(state[k], self.weight_dtype) for k in self.state_keys},
                           self.model_path, folder, self._version)
        return str(folder)

    def write_state_shards(self, store_url: str, storage_cfg, prefix: str, group: str = "policy") -> dict:
        """This rank's slices of the learner state, written by this rank under `prefix` of the checkpoint store
        (tasks/learner/shards.py) -> what the manifest lists of them."""
        from ...infra.storage.checkpoint import MAX_OBJECT_BYTES
        from ...infra.storage.store import open_store
        from .shards import local_state, write_local_state

        meta = {"format": STATE_FORMAT, "weight_version": self._version, "trainable": self.trainable,
                "model_keys": self.state_keys, "kl_coef": self.kl_coef, "lr_decay": asdict(self.lr_decay)}
        tensors, info = local_state(self.net, self.optimizer, self.param_names, self.state_keys, self.rank,
                                    self.world_size, meta)
        return write_local_state(open_store(store_url, storage_cfg), prefix, group, tensors, info, MAX_OBJECT_BYTES)

    def _advance_kl_coef(self, measured_kl: float, n_samples: int) -> dict:
        """-> {"kl_coef": the coefficient this update used}; the next one follows grpo.kl_ctrl (tasks/learner/kl_control.py)."""
        used, g = self.kl_coef, self.grpo
        if g.kl_coef > 0:
            self.kl_coef = next_kl_coef(used, measured_kl, n_samples, g.kl_ctrl, g.kl_target, g.kl_horizon)
        return {"kl_coef": used}

    def get_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Model + optimizer state as named tensors (safetensors-ready) and JSON-able meta (tasks/learner/state.py;
        sharded: rank 0's, the others return empty dicts)."""
        tensors, meta = save_state(self.net, self.model, self.optimizer, self.param_names, self.state_keys,
                                   self.sharded, self._version, self.trainable)
        return tensors, ({**meta, "kl_coef": self.kl_coef, "lr_decay": asdict(self.lr_decay)} if meta else meta)

    def set_state(self, tensors: dict, meta: dict) -> None:
        """Restore what get_state returned, at any world_size (tensors may be numpy arrays, e.g. safetensors.numpy)."""
        self._version = load_state(self.net, self.model, self.optimizer, self.param_names, self.state_keys,
                                   self.sharded, tensors, meta, self.model_path)
        self.kl_coef = float(meta.get("kl_coef", self.grpo.kl_coef))  # checkpoints before grpo.kl_ctrl have none
        steps = self.grpo.num_steps_per_rollout  # a resumed run with more iterations: optimizer.lr_extension
        self.lr_decay = self.optim_cfg.resumed_decay(DecaySpan(**meta["lr_decay"]), self._version * steps,
                                                     self.total_steps * steps)

    # ----- weight-update group (tasks/learner/weight_sender.py); Ray calls these by name -----
    def weight_specs(self) -> list[tuple[str, str, list[int]]]:
        return self.weight_sender.specs()

    def weight_sync_address(self) -> tuple[str, int]:
        return free_address()

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float = 600.0) -> bool:
        return self.weight_sender.join(master_address, master_port, world_size, group_name, backend, timeout_s)

    def leave_weight_group(self, group_name: str) -> bool:
        return self.weight_sender.leave(group_name)

    def broadcast_weights(self, group_name: str, buckets: list[list[str]]) -> dict:
        return self.weight_sender.broadcast(group_name, buckets)

    # ----- a colocated engine in this rank's process (tasks/learner/engine_host.py) -----
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def host_engine(self, backend: str, model_path: str, engine_index: int, **engine_kwargs) -> dict:
        """Build engine engine_index in this process (replacing a hosted one); returns its info()."""
        self.engine_host = self.engine_host or EngineHost()
        return self.engine_host.host(backend, model_path, engine_index, **engine_kwargs)

    def engine_call(self, name: str, *args, **kwargs):
        if self.engine_host is None:
            raise RuntimeError(f"engine_call({name!r}): this learner rank hosts no engine (host_engine first)")
        return self.engine_host.call(name, *args, **kwargs)

    def drop_engine(self) -> None:
        if self.engine_host is not None:
            self.engine_host.drop()

    def load_colocated_weights(self, weight_version: int, bucket_bytes: int) -> dict:
        """Every rank takes part (FSDP gathers each bucket); a hosting rank loads its engine."""
        host = self.engine_host or EngineHost()  # a rank that hosts no engine still gathers
        return host.load_weights(self.weight_sender, weight_version, bucket_bytes)

    def take_colocation_log(self) -> list[str]:
        return self.engine_host.take_log() if self.engine_host is not None else []

    def _note(self, event: str) -> None:
        if self.engine_host is not None:
            self.engine_host.note(event)
