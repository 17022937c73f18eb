"""The `placement` section: where the engines run relative to the learner.

colocate=true (MindSpeed-RL's hybrid engine, slime's --colocate, verl's hybrid worker): each policy learner rank
hosts one rollout engine in its own process and on its own device (tasks/learner/engine_host.py). The engines release
their memory after generation, so logprobs and the update get the whole device; they resume it after the
update and receive the new weights bucket by bucket from the rank that hosts them. Generation and training
never overlap, and the run starts no engine actors of its own.
"""
from __future__ import annotations

from pydantic import Field

from .base import Section

__all__ = ["PlacementConfig", "check_colocated_engines", "check_placement"]


class PlacementConfig(Section):
    colocate: bool = Field(False, description="Engines share the learner ranks' processes and devices (one engine per "
                           "policy rank: engines.rollout_num_gpus = learner.world_size, engines.gpus_per_engine = 1); "
                           "false: engines get their own actors and devices.")


def check_colocated_engines(engines, world_size: int) -> None:
    """One single-slot engine per policy rank (engines: the engines section)."""
    if engines.gpus_per_engine != 1 or engines.rollout_num_gpus != world_size:
        raise ValueError(f"placement.colocate hosts one engine in each policy learner rank: set engines.gpus_per_engine=1 "
                         f"and engines.rollout_num_gpus={world_size} (learner.world_size); got "
                         f"{engines.gpus_per_engine} and {engines.rollout_num_gpus}")


def check_placement(cfg) -> None:
    """What a colocated run needs of the other sections (cfg: RunConfig)."""
    if not cfg.placement.colocate:
        return
    engines, learner = cfg.engines, cfg.learner
    check_colocated_engines(engines, learner.world_size)
    if engines.weight_sync != "tensor":
        raise ValueError(f"placement.colocate sends the weights from the learner's own tensors (engines.weight_sync="
                         f"tensor); got engines.weight_sync={engines.weight_sync}")
    if engines.backend == "sglang" and learner.device != "cuda":
        raise ValueError("placement.colocate with engines.backend=sglang needs learner.device=cuda (the engine's server "
                         "runs on the rank's GPU)")
    if cfg.schedule.debug_rollout_only:
        raise ValueError("placement.colocate needs updates: with schedule.debug_rollout_only the engines would stay "
                         "released after the first generation; set placement.colocate=false")
