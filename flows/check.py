"""`spillover check`: the preflight that `train`, `resume`, `serve` and `eval` run first, before Prefect, Ray or any
model, and that users run alone to learn in seconds what would stop a run.

It checks the config (infra/config's validation), the data files read whole, the reward/rollout/env functions, the
storage, the model folder and tokenizer (and reward models named by Hub id), SGLang's flags (flows/check_inputs.py),
and the placement plan (infra/config/placement_plan.py) against the Ray cluster (`RAY_ADDRESS` or
engines.ray_address: joined, never started), this machine (what a local Ray would get), or `--gpus N [--nodes M]` for
a machine you are not on. A report is one line per problem, or the plan as a short table.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..infra.config.memory import memory_lines, model_shape
from ..infra.config.placement_plan import Cluster, PlacementPlan, placement_plan, plan_problems

__all__ = ["CheckReport", "cluster_from_ray", "local_cluster", "plan_table", "preflight"]


@dataclass(frozen=True)
class CheckReport:
    problems: list[str]
    plan: PlacementPlan
    cluster: Cluster
    memory: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def local_cluster() -> Cluster:
    """What a local Ray started on this machine would count, as Ray counts them: the GPUs of CUDA_VISIBLE_DEVICES,
    else the NVIDIA devices (/dev/nvidiaN, else `nvidia-smi -L`)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    else:
        gpus = len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia"):].isdigit()]) or _nvidia_smi_gpus()
    return Cluster(gpus=gpus, nodes=1, gpus_per_node=gpus, source="this machine")


def _nvidia_smi_gpus() -> int:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def cluster_from_ray(address: str | None) -> Cluster:
    """Join the Ray cluster at `address` (or the one this process already joined) and read its resources."""
    import ray

    from ..infra.cluster import init_ray

    if address and not ray.is_initialized():
        _reachable(address)  # ray.init retries an address where nothing listens for minutes
    init_ray(address)
    total = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    per_node = max((n["Resources"].get("GPU", 0) for n in alive), default=0)
    return Cluster(gpus=float(total.get("GPU", 0)), cpus=float(total.get("CPU", 0)), nodes=max(1, len(alive)),
                   gpus_per_node=per_node, source="the Ray cluster")


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError when nothing accepts a TCP connection at host:port of a Ray address."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port: let ray.init judge it
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(f"nothing answers at {host}:{port} ({err})") from None


def flag_cluster(gpus: float, nodes: int = 1) -> Cluster:
    source = f"the planned machine (--gpus {gpus:g}" + (f" --nodes {nodes})" if nodes > 1 else ")")
    return Cluster(gpus=gpus, nodes=nodes, gpus_per_node=gpus / nodes, source=source)


def choose_cluster(cfg, gpus: float | None, nodes: int = 1) -> Cluster:
    """--gpus N (a machine you are not on), else the joined or reachable Ray cluster, else this machine."""
    if gpus is not None:
        return flag_cluster(gpus, nodes)
    address = cfg.engines.ray_address or os.environ.get("RAY_ADDRESS")
    if address or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        return cluster_from_ray(address)
    return local_cluster()


def preflight(cfg, *, gpus: float | None = None, nodes: int = 1, purpose: str = "train",
              model_dir: str | Path | None = None, data_paths: dict[str, str] | None = None,
              storage_deadline_s: float = 10.0, resuming: bool = False, fresh: bool = False) -> CheckReport:
    """Every check for `purpose` ("train": train, resume and serve; "eval": engines only, no storage) of cfg (a
    RunConfig). model_dir: the folder engines load when not model.path (eval's exported policy); data_paths: more
    prompt files {setting: path} (eval's --data); resuming: `spillover resume` (what it starts: infra/config/placement_plan.py);
    fresh: a new run (`train`, `check`): its checkpoint location must hold no checkpoints yet."""
    from .check_inputs import (check_data, check_fresh_run_dir, check_imports, check_model, check_reward_models,
                               check_sglang_flags, check_storage_access)

    train = purpose == "train"
    tokenizer, problems = check_model(cfg, model_dir)
    problems += check_data(cfg if train else _without_training_data(cfg), tokenizer, data_paths)
    problems += check_imports(cfg, reward_only=not train)
    if train:
        problems += check_reward_models(cfg)
        problems += check_storage_access(cfg, storage_deadline_s)
    if train and fresh and not problems:
        problems += check_fresh_run_dir(cfg)
    problems += check_sglang_flags(cfg, model_dir)
    try:
        cluster = choose_cluster(cfg, gpus, nodes)
    except Exception as err:  # noqa: BLE001 -- ray.init's errors vary (ConnectionError, RuntimeError, timeouts)
        address = cfg.engines.ray_address or os.environ.get("RAY_ADDRESS")
        problems.append(f"cannot join the Ray cluster at {address} (engines.ray_address or RAY_ADDRESS): "
                        f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}; start "
                        "it, correct the address, or plan with --gpus N")
        cluster = Cluster(gpus=None, source="the Ray cluster")
    plan = placement_plan(cfg, cluster.gpus, eval_only=not train, resuming=resuming)
    problems += plan_problems(plan, cluster, cfg.storage.url, writes_checkpoints=train)
    return CheckReport(problems, plan, cluster, _memory(cfg, plan, model_dir))


def _without_training_data(cfg):
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"prompts_path": None, "eval_paths": {}})})


def _memory(cfg, plan: PlacementPlan, model_dir) -> list[str]:
    """The plan's memory lines when the model's config.json is here (a tiny model is built at start: none)."""
    path = Path(str(model_dir or cfg.model.path or "")).expanduser() / "config.json"
    if not (model_dir or cfg.model.path) or not path.is_file():
        return []
    try:
        return memory_lines(plan, cfg, model_shape(json.loads(path.read_text())))
    except (KeyError, ValueError, TypeError):
        return []


def plan_table(report: CheckReport) -> str:
    """The plan as a short table: one row per kind of actor, the total against the cluster, the memory lines."""
    rows = [("actor", "count", "CPUs each", "GPUs each", "set by")]
    rows += [(g.name, str(g.count), f"{g.cpus:g}", f"{g.gpus:g}", g.fields + (f"; {g.note}" if g.note else ""))
             for g in report.plan.groups]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    have = "unknown" if report.cluster.gpus is None else f"{report.cluster.gpus:g}"
    lines.append(f"total: {report.plan.total_gpus:g} GPUs, {report.plan.total_cpus:g} CPUs reserved; "
                 f"{report.cluster.source}: {have} GPUs")
    return "\n".join(lines + [f"memory, {line}" for line in report.memory])
