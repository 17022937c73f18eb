"""SGLang's weight-update group, shared by both ends: the trainer (rank 0, the sender) and the engines
(ranks rank_offset.., receivers).

The group is a side torch.distributed process group, created as SGLang's `init_custom_process_group` does
(a TCP rendezvous at `tcp://master_address:master_port`, a store prefixed by the group name, registered with
identity rank mapping), so it works with or without a default process group in the process and a learner built
on these helpers can feed real SGLang engines. Tensors travel by `broadcast(src=0)`, one per name, in order.

Buckets: the trainer sends the model in buckets of about `bucket_bytes` (whole tensors only: a tensor larger than
a bucket goes alone), so neither end holds more than one bucket beyond its model.
"""
from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["TensorSpec", "destroy_group", "dtype_from_name", "dtype_name", "init_group", "plan_buckets",
           "receive_bucket", "send_bucket", "tcp_store"]

TensorSpec = tuple[str, str, list[int]]  # (HF name, dtype name as SGLang sends it, shape)
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
               "int8": torch.int8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang's `dtypes` entries: torch attribute names)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name.removeprefix("torch.") not in DTYPE_NAMES:
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name.removeprefix("torch.")]


def spec_bytes(spec: TensorSpec) -> int:
    _, dtype, shape = spec
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into buckets of at most bucket_bytes each (in order); a tensor larger than
    bucket_bytes is a bucket of its own. specs[N] -> buckets[B][n_b], concatenating to specs."""
    if bucket_bytes <= 0:
        raise ValueError(f"engines.weight_bucket_bytes must be > 0; got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        nbytes = spec_bytes(spec)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def init_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group; returns once every rank has joined (or raises)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = PrefixStore(group_name, tcp_store(master_address, master_port, rank, world_size, timeout))
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store at host:port (torch's `tcp://` init). Rank 0 serves it on that address only: torch's
    own TCPStore server listens on every interface, and a cluster on loopback must not be reachable from outside."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))  # a port taken meanwhile fails here (EADDRINUSE): the callers pick another
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def destroy_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def send_bucket(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0: broadcast each tensor of one bucket, in order."""
    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_bucket(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Ranks > 0: the bucket's tensors, received in order into fresh buffers on `device`."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        buffer = torch.empty(tuple(int(d) for d in shape), dtype=dtype_from_name(dtype), device=device)
        dist.broadcast(buffer, src=0, group=group)
        out[name] = buffer
    return out
