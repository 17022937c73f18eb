"""Deployments of spillover (declared in prefect.yaml) served from this process, and starting their runs.

`spillover serve` reads prefect.yaml, builds each deployment with `flow.to_deployment(...)` and serves
them all with `prefect.serve(...)`: flow runs started from the UI, from `prefect deployment run` or from
`spillover submit` then run as subprocesses of the serving process. The training deployment's default
parameter is the config given to `serve` (--config + key=value); the nightly smoke run's cron comes from
--cron, else the config's schedule.cron, else prefect.yaml.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from .parts import RunParts
from ..infra.config.parsing import ConfigError
from ..infra.config.run_config import RunConfig, build_config, load_config

log = logging.getLogger("spillover")
REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "prefect.yaml"
TRAIN_DEPLOYMENT = "grpo-train/train"
SHUTDOWN_GRACE_S = 15.0  # how long a stop may take before `spillover serve` ends anyway


def _config_path(path: str) -> Path:
    """A config path as given, else relative to the repository (served runs may start in another cwd)."""
    p = Path(path)
    return p if p.is_file() or p.is_absolute() else REPO_ROOT / p


def smoke_run_dir(runs_dir: str, scheduled_start: datetime, flow_run_name: str) -> str:
    """<runs_dir>/<scheduled start, UTC>-<flow run name>: a run_dir of its own for each flow run of the smoke
    deployment. One run_dir holds one run (a fresh start where checkpoints are is refused), so a scheduled deployment
    that wrote to one fixed run_dir would fail every night after the first; the start time sorts the runs in the
    order they were scheduled, the flow run name tells apart two started in the same second."""
    return str(Path(runs_dir) / f"{scheduled_start.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}-{flow_run_name}")


@flow(name="spillover-smoke", log_prints=True)
def nightly_smoke(config_path: str = "configs/tiny.yaml", iterations: int = 3, runs_dir: str = "runs/nightly-smoke",
                  overrides: list[str] | None = None, parts: RunParts | None = None) -> dict:
    """A short training run of a config (the tiny one by default), in a new run_dir under runs_dir for each flow
    run (smoke_run_dir): does the whole pipeline still train? parts: as grpo_train's (None: started for the run)."""
    from prefect.runtime import flow_run

    from .train import grpo_train

    from ..infra.storage.checkpoint_list import newest_complete_checkpoint

    run_dir = smoke_run_dir(runs_dir, flow_run.scheduled_start_time, flow_run.name)
    cfg = load_config(_config_path(config_path),
                      [f"schedule.num_iterations={iterations}", f"run_dir={run_dir}", *(overrides or [])])
    # a retried flow run keeps its name and scheduled start, so its run_dir: it goes on from its checkpoint
    return grpo_train(cfg, resume=newest_complete_checkpoint(cfg) is not None, parts=parts)


def read_deployment_specs(path: Path = PREFECT_YAML) -> list[dict]:
    """The `deployments:` entries of prefect.yaml (name, entrypoint, parameters, schedules, ...)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: `spillover serve` reads the deployments declared there")
    specs = (yaml.safe_load(path.read_text()) or {}).get("deployments") or []
    if not specs:
        raise ConfigError(f"{path} declares no deployments (a `deployments:` list with name and entrypoint)")
    return specs


def config_parameter(cfg: RunConfig) -> dict:
    """RunConfig -> the JSON a deployment stores. Secrets never go there: they come from the environment."""
    data = cfg.model_dump(mode="json")
    storage = data.get("storage", {})
    for key in ("access_key_id", "secret_access_key"):
        if storage.get(key) is not None:
            log.warning("storage.%s is not stored in the deployment; set AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY in the environment of `spillover serve`", key)
            storage[key] = None
    return data


def _load_flow(entrypoint: str):
    known = {"flows/train.py:grpo_train": ("spillover.flows.train", "grpo_train"),
             "flows/serve.py:nightly_smoke": ("spillover.flows.serve", "nightly_smoke")}
    if entrypoint in known:
        import importlib

        module, name = known[entrypoint]
        return getattr(importlib.import_module(module), name)
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(entrypoint)


def _crons(spec: dict) -> list[str]:
    return [s["cron"] for s in spec.get("schedules") or [] if isinstance(s, dict) and s.get("cron")
            and s.get("active", True)]


def build_deployments(cfg: RunConfig, cron: str | None = None, only: list[str] | None = None,
                      specs: list[dict] | None = None) -> list:
    """RunnerDeployments for prefect.serve: the training config as the default parameter, cron applied."""
    from prefect.types.entrypoint import EntrypointType

    out = []
    for spec in specs if specs is not None else read_deployment_specs():
        if only and spec["name"] not in only:
            continue
        fl = _load_flow(spec["entrypoint"])
        params: dict[str, Any] = dict(spec.get("parameters") or {})
        crons = _crons(spec)
        if "config" in fl.parameters.properties:
            params["config"] = config_parameter(cfg)
        elif crons:  # the scheduled smoke run: --cron, else the config's schedule.cron, else prefect.yaml
            crons = [cron or cfg.schedule.cron or crons[0]]
        out.append(fl.to_deployment(
            name=spec["name"], cron=crons or None, parameters=params, description=spec.get("description"),
            tags=spec.get("tags"), entrypoint_type=EntrypointType.MODULE_PATH))
    if only and len(out) != len(only):
        names = [s["name"] for s in specs or read_deployment_specs()]
        raise ConfigError(f"--deployments {','.join(only)}: prefect.yaml declares {', '.join(names)}")
    return out


def serve_deployments(cfg: RunConfig, cron: str | None = None, only: list[str] | None = None,
                      limit: int | None = None) -> None:
    """Register the deployments and run their flow runs until interrupted (SIGTERM / Ctrl-C), as prefect.serve does,
    except that a stop ends within SHUTDOWN_GRACE_S: Prefect's graceful stop pauses the schedules on the server and,
    with the server gone, retries that for minutes (the process could then only be killed)."""
    import asyncio
    import signal

    from prefect.runner import Runner

    runner = Runner(limit=limit)
    deployments = build_deployments(cfg, cron, only)
    for deployment in deployments:
        runner.add_deployment(deployment)
    # Ctrl-C takes the same path as SIGTERM (the runner's handler, installed when it starts)
    signal.signal(signal.SIGINT, lambda *_: runner.handle_sigterm())
    threading.Thread(target=_end_a_stalled_stop, args=(runner, SHUTDOWN_GRACE_S), daemon=True,
                     name="serve-stop-deadline").start()
    print(f"serving {', '.join(d.name for d in deployments)} from this process (runs start from the Prefect UI, "
          "`spillover submit` or their schedules); stop with Ctrl-C or SIGTERM", flush=True)
    asyncio.run(runner.start())


def _end_a_stalled_stop(runner, grace_s: float) -> None:
    """Once the runner stops, give it grace_s to finish; then end the process (its flow runs are already cancelled
    or marked by then, or the server that would record it is gone)."""
    while not runner.stopping:
        time.sleep(0.2)
    time.sleep(grace_s)
    log.warning("spillover serve: the stop did not finish within %.0f s (is the Prefect server gone?); exiting", grace_s)
    logging.shutdown()
    os._exit(0)


def submit_run(deployment: str = TRAIN_DEPLOYMENT, config_file: str | None = None,
               overrides: list[str] | None = None, wait_s: float = 0.0, resume: bool = False):
    """Start a flow run of a served deployment; its config = config_file (else the deployment's default
    config) with key=value overrides applied and validated here; resume: the training flow goes on from its
    run_dir's newest checkpoint. Returns the FlowRun (final when waited)."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    parameters = None
    if config_file or overrides:
        if config_file:
            cfg = load_config(config_file, overrides)
        else:
            with get_client(sync_client=True) as client:
                defaults = client.read_deployment_by_name(deployment).parameters or {}
            cfg = build_config(dict(defaults.get("config") or {}), overrides)
        parameters = {"config": config_parameter(cfg)}
    if resume:
        parameters = {**(parameters or {}), "resume": True}
    return run_deployment(deployment, parameters=parameters, timeout=wait_s, as_subflow=False)
