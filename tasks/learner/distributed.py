"""The distributed pieces of the learner: process group, FSDP2 sharding, token-balanced shares, reductions.

A learner of world_size 1 on CPU uses none of it (no process group, a plain model). With world_size W > 1
every rank holds the whole RolloutBatch (its columns are small), trains on its own share of every mini-batch
(`balanced_shards`), and the loss of every rank is normalised by the same global token / sequence counts, so
the summed gradient (FSDP reduces with a divide factor of 1) equals world_size 1's.

Precision, the same rule on every path: parameters (the masters), and so AdamW's moments, are float32 whatever
model.dtype is (at lr 1e-6 an Adam step is ~1% of a bfloat16 ulp: bfloat16 masters would round it away);
forward and backward run in learner.param_dtype (FSDP2's MixedPrecisionPolicy when sharded, autocast when not:
`compute_precision`); engines receive model.dtype (tasks/weight_sync.for_engines casts what is sent).
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ...infra.config.learner import LearnerConfig
from ...rollout.sglang.update_group import tcp_store
from .packed_attention import use_packed_attention
from .token_logprobs import ResponseLogprobModel

__all__ = ["MASTER_DTYPE", "all_reduce", "balanced_shards", "checkpoint_layers", "compute_precision",
           "init_distributed", "load_learner_lm", "logprob_net", "shard_model"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MASTER_DTYPE = torch.float32


def balanced_shards(lengths, world_size: int) -> list[list[int]]:
    """Split rows (lengths[R] = tokens per row) into world_size shares of equal count (differing by at most one
    row) and near-equal token sums -> [world_size] lists of row indices, each ascending.

    Rows go longest first, in rounds of world_size: the longest rows of a round go to the lightest ranks, one each.
    Token sums then differ by at most the longest row's length (induction over rounds: pairing heavier ranks with
    shorter rows never widens the gap beyond the previous gap or one row). Pure and deterministic (stable sorts,
    ties to the lower rank), so every rank computes the same shares."""
    if world_size < 1:
        raise ValueError(f"learner.world_size must be >= 1; got {world_size}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    sums = np.zeros(world_size, dtype=np.int64)
    for start in range(0, len(order), world_size):
        rows = order[start:start + world_size]
        lightest = np.argsort(sums, kind="stable")[:len(rows)]
        for row, rank in zip(rows.tolist(), lightest.tolist()):
            shares[rank].append(row)
            sums[rank] += lengths[row]
    return [sorted(s) for s in shares]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                     timeout_s: float = 600.0) -> None:
    """Join the learner's process group (TCP rendezvous at rank 0's address)."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)  # this actor's process
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0 (CUDA_VISIBLE_DEVICES)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=tcp_store(master_addr, master_port, rank, world_size, timeout), rank=rank,
                            world_size=world_size, timeout=timeout)


def checkpoint_layers(layers) -> None:
    """Recompute each layer's activations in backward. Wraps forward in place (no wrapper module), so the
    state_dict keys stay the HF names; works in eval mode (HF's own switch acts only in train mode)."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def load_learner_lm(model_path: str, lcfg: LearnerConfig) -> torch.nn.Module:
    """The HF causal LM with the learner's attention kernel (learner.attn_implementation; packed micro-batches: its
    packed form), in eval mode, its parameters in float32 (the masters; a bfloat16 checkpoint is widened exactly)."""
    from transformers import AutoModelForCausalLM

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {model_path!r} has no config.json: point it at an HF checkpoint folder")
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=MASTER_DTYPE, local_files_only=True,
                                              attn_implementation=lcfg.attn_implementation)
    if lcfg.packs_sequences:  # every forward is then one packed row (tasks/learner/packed_attention.py)
        use_packed_attention(lm)
    return lm.eval()


def logprob_net(lm: torch.nn.Module, lcfg: LearnerConfig, temperature: float, sharded: bool, device: str,
                trainable: bool) -> torch.nn.Module:
    """lm on the learner's device inside the module that computes response logprobs (tasks/learner/token_logprobs.py),
    its FSDP2 root when sharded; frozen (trainable=False: a KL reference) it takes no gradients and is never
    checkpointed in backward."""
    if not trainable:
        lm.requires_grad_(False)
    if device == "cuda":
        lm.to("cuda")
    net = ResponseLogprobModel(lm, temperature, lcfg.logprob_chunk_tokens)
    layers = lm.get_decoder().layers
    if sharded:
        shard_model(net, layers, lcfg, trainable)
    elif trainable and lcfg.gradient_checkpointing:
        checkpoint_layers(layers)
    return net


def compute_precision(lcfg: LearnerConfig, sharded: bool, device: str):
    """The context a forward runs in: unsharded with learner.param_dtype below float32, autocast to it (matmuls
    and attention in bfloat16 from the float32 masters, the gradients float32 like the masters); sharded, nothing
    (FSDP2's MixedPrecisionPolicy casts the gathered parameters itself)."""
    import contextlib

    if sharded or lcfg.param_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=DTYPES[lcfg.param_dtype])


def shard_model(root: torch.nn.Module, layers, lcfg, trainable: bool) -> torch.nn.Module:
    """FSDP2: fully_shard each decoder layer, then the root (embedding, final norm, lm_head); mixed precision
    from learner.param_dtype / reduce_dtype. Gradients are summed over ranks, not averaged: each rank's loss is
    already divided by the global token / sequence count."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[lcfg.param_dtype], reduce_dtype=DTYPES[lcfg.reduce_dtype])
    if trainable and lcfg.gradient_checkpointing:
        checkpoint_layers(layers)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    for module in [*layers, root]:  # per FSDP module; plain SUM (gloo has no PREMUL_SUM, which a factor would use)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return root


def all_reduce(values: np.ndarray | list[float], op: str = "sum") -> np.ndarray:
    """Element-wise sum or max of a float64 vector over the ranks (the vector itself without a process group)."""
    tensor = torch.tensor(np.asarray(values, dtype=np.float64))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor.numpy()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = tensor.to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.cpu().numpy()
