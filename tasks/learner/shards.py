"""Sharded learner state: each rank's own slice of every parameter and AdamW moment, written by that rank.

FSDP2 shards every parameter on dim 0 like torch.chunk (rank r holds rows [r * ceil(n / W), ...)); a rank's
slice is stored as-is (`model/<HF name>`, `optim/<index>/<name>`, the same names as tasks/learner/state.py),
and its layout (global shape, row offset) as JSON. Rank 0 also stores what is not sharded: 0-dim optimizer
values (AdamW's step), buffers, the torch RNG, and the meta. `assemble` puts the slices of all ranks back into
the full state that LearnerActor.set_state takes, so a checkpoint written at one world_size resumes at any.
Nothing is pickled, and nothing is gathered to one rank to save.
"""
from __future__ import annotations

import json

import torch

__all__ = ["assemble", "local_state", "write_local_state"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _row_offset(global_rows: int, world_size: int, rank: int) -> int:
    """torch.chunk's (and FSDP2's Shard(0)'s) first row of rank's slice."""
    return min(rank * -(-global_rows // world_size), global_rows)


def local_state(net, optimizer, param_names: list[str], state_keys: list[str], rank: int, world_size: int,
                meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's slices -> (tensors, layout: {name: {"shape": global shape, "offset": first row}}); meta: the
    learner's JSON meta without tensors (rank 0 stores it, with the optimizer's param groups)."""
    params = dict(net.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}

    def put(name: str, value: torch.Tensor) -> None:
        if value.dim() == 0 or not hasattr(value, "to_local"):  # not sharded: rank 0 stores it whole
            if rank == 0:
                tensors[name] = value.detach().cpu().clone().contiguous()
                layout[name] = {"shape": list(value.shape), "offset": None}
            return
        tensors[name] = _local(value).detach().cpu().clone().contiguous()
        layout[name] = {"shape": list(value.shape), "offset": _row_offset(value.shape[0], world_size, rank)}

    buffers = dict(net.named_buffers())
    for key in state_keys:
        put(f"model/{key}", params.get(f"lm.{key}", buffers.get(f"lm.{key}")))
    if optimizer is not None:
        for idx, name in enumerate(param_names):
            for slot, value in optimizer.state.get(params[f"lm.{name}"], {}).items():
                if torch.is_tensor(value):
                    put(f"optim/{idx}/{slot}", value)
        groups = optimizer.state_dict()["param_groups"]
        meta = {**meta, "optimizer_param_groups": groups, "optimizer_scalars": {}}
    if rank == 0:
        tensors["rng/torch"] = torch.get_rng_state()
        layout["rng/torch"] = {"shape": list(tensors["rng/torch"].shape), "offset": None}
    json.dumps(meta)
    return tensors, {"rank": rank, "world_size": world_size, "layout": layout, "meta": meta if rank == 0 else None}


def assemble(parts: list[tuple[dict, dict]]) -> tuple[dict[str, torch.Tensor], dict]:
    """[(tensors, layout info) of every rank] -> (full tensors, meta) for LearnerActor.set_state."""
    parts = sorted(parts, key=lambda p: p[1]["rank"])
    if [p[1]["rank"] for p in parts] != list(range(parts[0][1]["world_size"])):
        raise ValueError(f"learner shards of ranks {[p[1]['rank'] for p in parts]} do not make up world_size "
                         f"{parts[0][1]['world_size']}")
    slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
    full: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for tensors, info in parts:
        for name, spec in info["layout"].items():
            value = torch.as_tensor(tensors[name])
            shapes[name] = spec["shape"]
            if spec["offset"] is None:
                full[name] = value
            else:
                slices.setdefault(name, []).append((spec["offset"], value))
    for name, pieces in slices.items():
        pieces.sort(key=lambda p: p[0])
        value = torch.cat([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]
        if list(value.shape) != shapes[name]:
            raise ValueError(f"learner shards of {name} make shape {list(value.shape)}, not {shapes[name]}")
        full[name] = value
    return full, parts[0][1]["meta"]


def write_local_state(store, prefix: str, group: str, tensors: dict, info: dict, max_object_bytes: int) -> dict:
    """Write this rank's tensors as `<prefix>/tensors/<group>-rank<r>-<i>.safetensors` -> {"objects": {key: {size,
    sha256}}, "groups": {"tensors": {<group>-rank<r>: [keys]}}, "info": layout and meta} (keys relative to prefix:
    the run's one manifest, written last by the driver, lists them; the driver keeps `info` in the checkpoint's
    meta.json)."""
    from ...infra.storage import checkpoint_objects as objects_io
    from ...infra.storage.checkpoint_objects import TENSORS

    name = f"{group}-rank{info['rank']:03d}"
    values = objects_io.tensors_for_save(name, tensors)
    objects, keys = {}, []
    for i, shard in enumerate(objects_io.split_shards(values, max_object_bytes)):
        key = f"{TENSORS}/{name}-{i:05d}.safetensors"
        found = objects_io.put_object(store, f"{prefix}/{key}", TENSORS, shard)
        objects[key] = {"size": found.size, "sha256": found.sha256}
        keys.append(key)
    return {"objects": objects, "groups": {TENSORS: {name: keys}}, "info": info}
