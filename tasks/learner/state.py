"""Learner state as named tensors (safetensors-ready) + JSON meta, the same format at every world_size.

Model tensors are `model/<HF name>` (tied duplicates dropped), optimizer tensors `optim/<index>/<name>` with the
index of the parameter in the unsharded model's `named_parameters()` order, so a state saved by an FSDP group
loads into one process and back (resharding is FSDP's: each rank keeps its slice of the full tensors).
With FSDP the full tensors are gathered to rank 0 (other ranks return empty dicts; every rank must call).
Model and optimizer tensors are the learner's float32 masters and moments whatever model.dtype is; a state holding
bfloat16 ones (a learner whose masters were bfloat16 wrote them) still loads, widened exactly: load_state_dict and
AdamW's load_state_dict cast to the parameters' dtype.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict

import numpy as np
import torch

from ...infra.config.training import DecaySpan

__all__ = ["STATE_FORMAT", "from_format_1", "full_model_state", "load_state", "save_hf_folder", "save_state",
           "unique_state_keys"]
# 2: the learner records its lr decay span ("lr_decay", infra/config/training.py DecaySpan) next to kl_coef
STATE_FORMAT = 2


def from_format_1(meta: dict, decay_horizon: int) -> dict:
    """A format-1 meta (written before the learner recorded its lr decay) as format 2. A format-1 run decayed from
    update 0 over its config's horizon (optimizer.decay_steps, else num_iterations x num_steps_per_rollout of the
    config the checkpoint records): decay_horizon, which the caller reads there."""
    if meta.get("format") != 1:
        raise ValueError(f"from_format_1: learner state format {meta.get('format')!r} is not 1")
    return {**meta, "format": STATE_FORMAT, "lr_decay": asdict(DecaySpan(0, 0.0, int(decay_horizon)))}


def unique_state_keys(lm: torch.nn.Module) -> list[str]:
    """state_dict keys with tied duplicates (e.g. lm_head = embed_tokens) dropped: safetensors refuses shared
    tensors, and loading the first key fills both. Call on the unsharded model."""
    seen, keys = set(), []
    for key, value in lm.state_dict().items():
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            keys.append(key)
    return keys


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(root: torch.nn.Module, lm: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """HF-named model tensors. sharded: gathered from the FSDP root to rank 0's CPU ({} on other ranks)."""
    if not sharded:
        return {k: v.detach() for k, v in lm.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(root, options=_options(cpu_offload=True))
    return {k[len("lm."):]: v for k, v in full.items() if k.startswith("lm.")}


def save_state(root, lm, optimizer, param_names: list[str], state_keys: list[str], sharded: bool,
               version: int, trainable: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of model + optimizer + torch RNG; on ranks other than 0 of a sharded learner ({}, {})."""
    model_sd = full_model_state(root, lm, sharded)
    opt = None
    if optimizer is not None:
        if sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            full = get_optimizer_state_dict(root, optimizer, options=_options(cpu_offload=True))
            index = {f"lm.{name}": i for i, name in enumerate(param_names)}
            groups = [dict(g, params=[index[p] for p in g["params"]]) for g in full.get("param_groups", [])]
            opt = {"state": {index[fqn]: s for fqn, s in full.get("state", {}).items()}, "param_groups": groups}
        else:
            opt = optimizer.state_dict()
    if sharded and torch.distributed.get_rank() != 0:
        return {}, {}
    tensors = {f"model/{k}": model_sd[k].detach().cpu().clone().contiguous() for k in state_keys}
    meta: dict = {"format": STATE_FORMAT, "weight_version": version, "trainable": trainable, "model_keys": state_keys}
    if opt is not None:
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


def load_state(root, lm, optimizer, param_names: list[str], state_keys: list[str], sharded: bool,
               tensors: dict, meta: dict, model_path: str) -> int:
    """Restore what save_state returned (tensors may be numpy arrays, e.g. from safetensors.numpy); every rank of a
    sharded learner gets the full tensors and keeps its slice -> the weight version."""
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"learner state format {meta.get('format')!r} is not {STATE_FORMAT}; "
                         "the checkpoint was written by another version")
    as_tensor = {k: torch.as_tensor(np.asarray(v)) if not torch.is_tensor(v) else v for k, v in tensors.items()}
    model_sd = {k[len("model/"):]: v for k, v in as_tensor.items() if k.startswith("model/")}
    if set(model_sd) != set(state_keys):
        missing, extra = sorted(set(state_keys) - set(model_sd))[:5], sorted(set(model_sd) - set(state_keys))[:5]
        raise ValueError(f"learner state does not fit model {model_path}: missing {missing}, extra {extra}")
    if sharded:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(root, {f"lm.{k}": v for k, v in model_sd.items()}, options=_options(strict=False))
    else:
        result = lm.load_state_dict(model_sd, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"learner state has unexpected model keys {result.unexpected_keys[:5]}")
    if optimizer is not None:
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
        groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in meta["optimizer_param_groups"]]
        # the AdamW kernel (fused on CUDA, the per-parameter loop on CPU) is this machine's choice, not the checkpoint's
        kernel = {k: optimizer.param_groups[0][k] for k in ("foreach", "fused") if k in optimizer.param_groups[0]}
        groups = [dict(g, **kernel) for g in groups]
        if sharded:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            fqn = [f"lm.{name}" for name in param_names]
            full = {"state": {fqn[i]: s for i, s in state.items()},
                    "param_groups": [dict(g, params=[fqn[i] for i in g["params"]]) for g in groups]}
            set_optimizer_state_dict(root, optimizer, full, options=_options())
        else:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
    if "rng/torch" in as_tensor:
        torch.set_rng_state(as_tensor["rng/torch"].to(torch.uint8).cpu())
    return int(meta["weight_version"])


def save_hf_folder(lm, state: dict[str, torch.Tensor], model_path: str, folder: str, version: int) -> str:
    """An HF folder (safetensors + config + the model's tokenizer) of `state` (config.json's dtype: the tensors'),
    for /update_weights_from_disk."""
    from pathlib import Path

    from ...infra.models import load_tokenizer

    final = Path(folder)
    # written beside it, then renamed into place: an engine never reads a folder half written (or one a run before
    # left at this version and this run is overwriting)
    out = final.with_name(f"{final.name}.partial-{uuid.uuid4().hex[:8]}")
    out.mkdir(parents=True)
    lm.save_pretrained(out, state_dict=state, safe_serialization=True)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:  # save_pretrained records the model's (float32 master) dtype, not the tensors' it wrote
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = str(floats.pop()).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    try:
        load_tokenizer(model_path).save_pretrained(out)
    except (OSError, ValueError):  # a model folder without a tokenizer: engines keep theirs
        pass
    (out / "spillover_weights.json").write_text(json.dumps({"weight_version": version}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out, final)
    return str(final)
