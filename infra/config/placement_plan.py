"""The placement plan: every Ray actor a run starts, with the CPUs and GPUs it reserves, from the config alone.

One place counts what flows/setup.py starts (tasks/learner/group.py: the policy ranks, and the reference ranks when
grpo.kl_coef > 0 with learner.reference_placement=separate, none when the policy's ranks hold the reference;
rollout/fleet/engine_pool.py: the engines' bundles, none when placement.colocate puts them in the policy
ranks; rollout/scoring/reward_models.py: one actor per grpo.reward_models entry), so that `spillover check` and the start of a
run refuse what the cluster cannot hold before any placement group waits for it. The bundle shapes below are the
ones those modules request (they import them from here).

Pure functions of a RunConfig (and what is known of the cluster); no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActorGroup", "Cluster", "PlacementPlan", "engine_bundle", "engines_on_gpu", "is_local_storage",
           "learner_bundle", "needs_engines", "placement_plan", "plan_problems"]

MIN_BUNDLE_CPU = 0.01  # a Ray bundle must hold something; CPU actors reserve almost nothing (MACHINE-NOTES)
GPU_ENGINE_ACTOR_CPU = 0.2  # a GPU engine's bundle: the actor only supervises its SGLang process


@dataclass(frozen=True)
class ActorGroup:
    """`count` actors of one kind, each reserving `cpus` and `gpus` in Ray; `fields`: the settings that set them."""
    name: str
    count: int
    cpus: float
    gpus: float
    fields: str
    note: str = ""

    @property
    def total_gpus(self) -> float:
        return self.count * self.gpus

    @property
    def total_cpus(self) -> float:
        return self.count * self.cpus


@dataclass(frozen=True)
class PlacementPlan:
    groups: tuple[ActorGroup, ...]
    spread_learner: bool = False  # learner.placement_strategy asks for ranks on different nodes
    engine_gpus: int = 0          # GPUs of one engine (engines.gpus_per_engine) when engines sit on GPUs
    # the setting by which SGLang engines load new weights through CUDA IPC handles (memory on the engine's first
    # node), with the GPUs of one such engine; "" when none does
    ipc_weights: str = ""
    ipc_engine_gpus: int = 0

    @property
    def total_gpus(self) -> float:
        return sum(g.total_gpus for g in self.groups)

    @property
    def total_cpus(self) -> float:
        return sum(g.total_cpus for g in self.groups)

    def gpu_breakdown(self) -> str:
        """'policy learner 1 (learner.world_size x learner.gpus_per_rank) + ...' over the groups that hold GPUs."""
        return " + ".join(f"{g.name} {g.total_gpus:g} ({g.fields})" for g in self.groups if g.total_gpus)


@dataclass(frozen=True)
class Cluster:
    """What the plan is checked against: Ray's cluster_resources() and alive nodes, or `spillover check --gpus N`."""
    gpus: float | None          # None: unknown (nothing to check GPUs against)
    cpus: float | None = None
    nodes: int = 1
    gpus_per_node: float | None = None
    source: str = "--gpus"      # where the numbers come from, for messages: "--gpus 4", "the Ray cluster"


def learner_bundle(lcfg) -> dict[str, float]:
    """The Ray bundle of one learner rank (lcfg: the learner section)."""
    return {"CPU": max(lcfg.num_cpus_per_rank, MIN_BUNDLE_CPU), **({"GPU": lcfg.gpus_per_rank} if lcfg.device == "cuda"
                                                                   else {})}


def engine_bundle(engines, use_gpu: bool) -> dict[str, float]:
    """The Ray bundle of one engine slot (engines.rollout_num_gpus of them; an engine takes gpus_per_engine)."""
    cpu = max(engines.num_cpus_per_engine / engines.gpus_per_engine, MIN_BUNDLE_CPU)
    return {"GPU": 1, "CPU": max(cpu, GPU_ENGINE_ACTOR_CPU)} if use_gpu else {"CPU": cpu}


def engines_on_gpu(engines, cluster_gpus: float | None) -> bool:
    """rollout/fleet/engine_pool.py's rule: SGLang engines always sit on GPUs; torch engines do when the cluster has
    engines.rollout_num_gpus GPUs (unknown cluster: on CPU)."""
    return engines.backend == "sglang" or (cluster_gpus or 0) >= engines.rollout_num_gpus


def needs_engines(cfg) -> bool:
    """Engines generate; replayed debug data and SFT samples need them only for eval."""
    return not cfg.schedule.debug_train_only and (not cfg.rollout.sft or bool(cfg.data.eval_paths))


def placement_plan(cfg, cluster_gpus: float | None = None, eval_only: bool = False,
                   resuming: bool = False) -> PlacementPlan:
    """The actors `spillover train` (or, eval_only, `spillover eval`: engines alone) starts for cfg (a RunConfig).
    cluster_gpus decides where torch engines go (engines_on_gpu). schedule.debug_rollout_only starts no learner
    unless resuming (the policy then carries the checkpoint's weights to the engines)."""
    groups: list[ActorGroup] = []
    learner = cfg.learner
    colocated = cfg.placement.colocate and not eval_only
    learners = not eval_only and (not cfg.schedule.debug_rollout_only or resuming)
    if learners:
        rank = learner_bundle(learner)
        kl = cfg.grpo.kl_coef > 0
        hosts = [what for what, held in (("the engines (placement.colocate)", colocated),
                                         (f"the KL reference (learner.reference_placement={learner.reference_placement})",
                                          kl and learner.reference_with_policy)) if held]
        groups.append(ActorGroup("policy learner", learner.world_size, rank["CPU"], rank.get("GPU", 0.0),
                                 "learner.world_size x learner.gpus_per_rank" if rank.get("GPU") else
                                 "learner.world_size", "hosts " + " and ".join(hosts) if hosts else ""))
        if kl and not learner.reference_with_policy:
            groups.append(ActorGroup("reference learner", learner.world_size, rank["CPU"], rank.get("GPU", 0.0),
                                     "grpo.kl_coef > 0, learner.reference_placement=separate: learner.world_size x "
                                     "learner.gpus_per_rank" if rank.get("GPU") else
                                     "grpo.kl_coef > 0, learner.reference_placement=separate",
                                     "frozen copy of the policy, sharded the same way"))
    for i, rm in enumerate(() if eval_only else cfg.grpo.reward_models):
        groups.append(ActorGroup(f"reward model {rm.name or i}", 1, 0.0, rm.num_gpus,
                                 f"grpo.reward_models[{i}].num_gpus", rm.path))
    engines, engine_gpus = cfg.engines, 0
    if eval_only or needs_engines(cfg):
        if colocated:
            groups.append(ActorGroup("engine", engines.num_engines, 0.0, 0.0, "placement.colocate",
                                     "inside the policy ranks: no GPUs of its own"))
        else:
            on_gpu = engines_on_gpu(engines, cluster_gpus)
            slot = engine_bundle(engines, on_gpu)
            per_engine = engines.gpus_per_engine
            engine_gpus = per_engine if on_gpu else 0
            groups.append(ActorGroup("engine", engines.num_engines, slot["CPU"] * per_engine,
                                     slot.get("GPU", 0.0) * per_engine,
                                     "engines.rollout_num_gpus / engines.gpus_per_engine",
                                     f"{engines.backend}, {per_engine} GPU(s) each (engines.gpus_per_engine)" if on_gpu
                                     else f"{engines.backend} on CPU"))
    spread = learners and learner.world_size > 1 and learner.placement_strategy in ("SPREAD", "STRICT_SPREAD")
    ipc = ipc_weight_setting(cfg, colocated) if learners and needs_engines(cfg) else ""
    return PlacementPlan(tuple(groups), spread_learner=spread, engine_gpus=engine_gpus, ipc_weights=ipc,
                         ipc_engine_gpus=engines.gpus_per_engine if ipc else 0)


def ipc_weight_setting(cfg, colocated: bool) -> str:
    """The setting that makes SGLang engines on GPUs of their own load each update from CUDA IPC handles, or "".
    (Colocated engines load that way too, but placement.colocate already holds each one to a single GPU.)"""
    if cfg.engines.backend != "sglang" or colocated:
        return ""
    return "engines.weight_sync=tensor" if cfg.engines.weight_sync == "tensor" else ""


def _gpus(count: float) -> str:
    return f"{count:g} GPU" + ("" if count == 1 else "s")


def is_local_storage(url: str | None) -> bool:
    """storage.url on this node's disk (a path, file://, or empty = <run_dir>/checkpoints), not object storage."""
    return not (url or "").startswith("s3://")


def spans_nodes(plan: PlacementPlan, cluster: Cluster) -> str | None:
    """Why the run's actors may land on more than one node, or None."""
    if cluster.nodes > 1:
        return f"the run's actors may land on any of {cluster.nodes} nodes ({cluster.source})"
    if plan.spread_learner:
        return "learner.placement_strategy spreads the ranks over nodes"
    if cluster.gpus_per_node and plan.engine_gpus > cluster.gpus_per_node:  # (0: no GPU here; counted elsewhere)
        return f"an engine's {plan.engine_gpus} GPUs (engines.gpus_per_engine) span nodes"
    return None


def plan_problems(plan: PlacementPlan, cluster: Cluster, storage_url: str | None = None,
                  writes_checkpoints: bool = True) -> list[str]:
    """One line per reason the cluster cannot hold the plan (GPUs, CPUs, an engine across nodes), and multi-node
    placement with node-local checkpoint storage."""
    problems = []
    if cluster.gpus is not None and plan.total_gpus > cluster.gpus + 1e-9:
        reference = any(g.name == "reference learner" and g.gpus for g in plan.groups)
        hint = (" (learner.reference_placement=with_policy runs the reference on the policy's GPUs, grpo.kl_coef=0 "
                "drops it)" if reference else "")
        problems.append(f"the run needs {_gpus(plan.total_gpus)} ({plan.gpu_breakdown()}) but {cluster.source} has "
                        f"{cluster.gpus:g}; lower those settings{hint} or add GPUs")
    if cluster.cpus is not None and plan.total_cpus > cluster.cpus + 1e-9:
        problems.append(f"the run's actors reserve {plan.total_cpus:g} CPUs (learner.num_cpus_per_rank, "
                        f"engines.num_cpus_per_engine) but {cluster.source} has {cluster.cpus:g}; lower them")
    per_node = cluster.gpus_per_node
    if per_node and plan.engine_gpus > per_node and plan.engine_gpus % per_node:
        problems.append(f"engines.gpus_per_engine ({plan.engine_gpus}) spans nodes, so it must be a multiple of the "
                        f"GPUs per node ({per_node:g})")
    if per_node and plan.ipc_weights and plan.ipc_engine_gpus > per_node:
        problems.append(f"{plan.ipc_weights} hands every SGLang engine CUDA IPC handles to weights on its first node, "
                        f"which the ranks of an engine spanning nodes (engines.gpus_per_engine={plan.ipc_engine_gpus} "
                        f"> {per_node:g} GPUs per node) cannot open; set engines.weight_sync=distributed, or "
                        f"engines.gpus_per_engine <= {per_node:g}")
    why = spans_nodes(plan, cluster)
    if writes_checkpoints and why and is_local_storage(storage_url):
        problems.append(f"storage.url={storage_url or '(empty: <run_dir>/checkpoints)'} is on this node's disk but "
                        f"{why}: learner ranks on other nodes would write their checkpoint shards to their own disks "
                        "and resume would not find them; set storage.url=s3://BUCKET/PREFIX (with "
                        "storage.endpoint_url for a self-hosted S3)")
    return problems
