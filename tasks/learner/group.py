"""A learner group: learner.world_size LearnerActor ranks in one Ray placement group, behind one handle.

`LearnerGroup` looks like one actor handle to the tasks: `group.update.remote(batch_ref, old_ref, ref_ref)`
calls the method on every rank (each rank resolves the ObjectRefs itself) and returns one ObjectRef with rank
0's result. For small results that ref is a zero-CPU Ray task over all ranks' results, so an error on any rank
reaches the caller; for the weights (`state_dict_ref`, `get_state`), whose rank-0 result is the whole model, it
is rank 0's own ref (no second copy; the other ranks take part in the gather and return empty dicts, and their
errors surface at the group's next call).

Rank 0's node address and a free port there are the torch.distributed rendezvous; world_size 1 on CPU uses
no process group at all (tasks/learner/actor.py).
"""
from __future__ import annotations

import logging
import socket

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ...infra.config.learner import LearnerConfig, check_learner_start
from .actor import LearnerActor

__all__ = ["LearnerGroup", "create_learner_group", "create_learners"]
log = logging.getLogger(__name__)
RANK0_ONLY = ("state_dict_ref", "state_dict_refs", "get_state")  # big results: rank 0's ref as is
RENDEZVOUS_ATTEMPTS = 3
BUNDLE_MIN_CPU = 0.01  # a bundle needs some resource; zero-CPU ranks would leave Ray's CPU slots to the engines


@ray.remote(num_cpus=0)
def _rank0_result(first, *others):
    """Runs once every rank's result exists (Ray resolves the arguments: a failed rank fails this)."""
    return first


@ray.remote(num_cpus=0)
def _free_address() -> tuple[str, int]:
    """This node's address and a port free on it (rank 0's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class _GroupMethod:
    def __init__(self, group: "LearnerGroup", name: str):
        self.group, self.name = group, name

    def remote(self, *args, **kwargs):
        group = self.group
        group.check_pending()
        refs = [getattr(actor, self.name).remote(*args, **kwargs) for actor in group.actors]
        if len(refs) == 1:
            return refs[0]
        if self.name in RANK0_ONLY:
            group.pending.extend(refs[1:])
            return refs[0]
        return _rank0_result.remote(*refs)


class _OnEveryRank:
    """A LearnerActor method that the group calls on every rank: `group.<name>.remote(...)` (see _GroupMethod)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, group: "LearnerGroup | None", owner=None):
        return self if group is None else _GroupMethod(group, self.name)


class LearnerGroup:
    """world_size ranks of one learner (policy or reference); `.method.remote(...)` -> ObjectRef of rank 0's result.
    The methods below are tasks/learner/actor.py LearnerActor's that run on every rank; per-rank ones (shards,
    colocated engines) go through `each` or the actors themselves."""

    compute_logprobs = _OnEveryRank()
    compute_ref_logprobs = _OnEveryRank()
    update = _OnEveryRank()
    weight_version = _OnEveryRank()
    state_dict_ref = _OnEveryRank()
    state_dict_refs = _OnEveryRank()
    save_weights = _OnEveryRank()
    get_state = _OnEveryRank()
    set_state = _OnEveryRank()
    weight_specs = _OnEveryRank()
    weight_sync_address = _OnEveryRank()
    join_weight_group = _OnEveryRank()
    leave_weight_group = _OnEveryRank()
    broadcast_weights = _OnEveryRank()

    def __init__(self, actors: list, pg=None, master: tuple[str, int] | None = None):
        self.actors, self.pg, self.pending, self.master = list(actors), pg, [], master  # master: rank 0's rendezvous

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def each(self, name: str, *args, **kwargs) -> list:
        """Call a method on every rank -> [ObjectRef of each rank's result] (e.g. write_state_shards)."""
        self.check_pending()
        return [getattr(actor, name).remote(*args, **kwargs) for actor in self.actors]

    def check_pending(self) -> None:
        """Raise the error of an earlier rank-0-only call's other ranks, if any failed."""
        done = [ref for ref in self.pending if ray.wait([ref], timeout=0)[0]]
        self.pending = [ref for ref in self.pending if ref not in done]
        ray.get(done)

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.actors, self.pg, self.pending = [], None, []


def create_learner_group(model_path, cfg, trainable: bool, lcfg: LearnerConfig | None = None) -> LearnerGroup:
    """Start lcfg.world_size ranks (cfg.learner unless given) of the policy (trainable) or the frozen reference."""
    lcfg = lcfg or cfg.learner
    cuda = lcfg.device == "cuda"
    bundle = {"CPU": max(lcfg.num_cpus_per_rank, BUNDLE_MIN_CPU), **({"GPU": lcfg.gpus_per_rank} if cuda else {})}
    pg = placement_group([dict(bundle) for _ in range(lcfg.world_size)], strategy=lcfg.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=600)
    except BaseException:  # not placed in time: its pending request would hold the resources it gets later
        remove_placement_group(pg)
        raise

    def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)

    actor_cls = ray.remote(LearnerActor)

    def start_ranks(master) -> list:
        return [actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                  scheduling_strategy=in_bundle(rank))
                .remote(str(model_path), **rank_options(cfg, trainable, lcfg, rank, master))
                for rank in range(lcfg.world_size)]

    if not (lcfg.world_size > 1 or cuda):
        return LearnerGroup(start_ranks(None), pg)
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        # The port was free when rank 0's node was asked; another process may take it before rank 0 listens
        # (EADDRINUSE): then the other ranks would wait for rank 0 for ever, so the group starts again.
        master = ray.get(_free_address.options(scheduling_strategy=in_bundle(0)).remote())
        actors = start_ranks(master)
        try:
            ray.get(actors[0].weight_version.remote())  # rank 0's constructor returns once every rank has joined
            return LearnerGroup(actors, pg, master)
        except ray.exceptions.RayActorError as err:
            for actor in actors:
                ray.kill(actor)
            if "EADDRINUSE" not in str(err) or attempt == RENDEZVOUS_ATTEMPTS:
                remove_placement_group(pg)
                raise
            log.warning("learner rendezvous port %s:%d was taken before rank 0 listened; starting the ranks again",
                        *master)


def rank_options(cfg, trainable: bool, lcfg: LearnerConfig, rank: int = 0, master=None) -> dict:
    """LearnerActor's constructor arguments (after the model folder) for one rank of a run."""
    return dict(grpo_cfg=cfg.grpo, optim_cfg=cfg.optimizer, temperature=cfg.rollout.temperature, seed=cfg.model.seed,
                trainable=trainable, dtype=cfg.model.dtype, total_steps=cfg.schedule.num_iterations,
                learner_cfg=lcfg, rank=rank, master=master)


def create_learners(model_path, cfg, start_group=None) -> tuple[LearnerGroup, LearnerGroup | None]:
    """The policy group, and the frozen reference group (sharded the same way) when grpo.kl_coef > 0 and
    learner.reference_placement=separate (with_policy: the policy's ranks hold the reference themselves).
    start_group(trainable) -> group: how a group is got (flows/parts.py borrows kept ones); default: started.

    Refuses at start what the cluster cannot run (learner.device=cuda without enough GPUs, flash attention
    not installed): check_learner_start, before any actor starts."""
    check_learner_start(cfg.learner, ray.cluster_resources())
    start_group = start_group or (lambda trainable: create_learner_group(model_path, cfg, trainable=trainable))
    policy = start_group(True)
    try:
        ref = start_group(False) if cfg.grpo.kl_coef > 0 and not cfg.learner.reference_with_policy else None
    except BaseException:
        policy.shutdown()
        raise
    return policy, ref
