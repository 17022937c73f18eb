"""sha256 digests of model weights, for bit-for-bit comparisons across processes (benchmarks and tests compare what
the engines serve with what the learner holds).

The readers of a live process take the Ray actor's instance and run inside it, through Ray's
`actor.__ray_call__.remote(reader)`, so that the learner and engine classes carry no method a run never calls.
"""
from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape prefixed)."""
    t = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def learner_weight_digests(learner) -> dict[str, str]:
    """Inside a learner rank (spillover.tasks.learner.actor.LearnerActor): the digest of every tensor the engines
    load, in model.dtype. Sharded, each tensor is gathered (a collective: every rank runs this; rank 0's are the
    ones to compare)."""
    from ..tasks.learner.weight_sender import full_tensor

    return {name: tensor_digest(full_tensor(t)) for name, t in learner.weight_sender.named_weights().items()}


def learner_group_weight_digests(group) -> dict[str, str]:
    """Rank 0's learner_weight_digests of a spillover.tasks.learner.group.LearnerGroup, run on every rank."""
    import ray

    return ray.get([actor.__ray_call__.remote(learner_weight_digests) for actor in group.actors])[0]


def engine_weight_digests(engine) -> dict[str, str]:
    """Inside an engine (spillover.rollout.fleet.engine_actor.EngineActor, torch backend, node 0): the digest of
    every tensor it serves."""
    return {name: tensor_digest(t) for name, t in engine.server.batcher.decoder.weights.items()}
