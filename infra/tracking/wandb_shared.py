"""wandb for a training run: the driver's run, and Ray actors joining that same run.

Modes (tracking.wandb_mode): `disabled` -> nothing is imported or written; `offline` (default) -> records
under <run_dir>/wandb/offline-run-*, no network; `online` -> wandb's shared mode, so that several
processes (the driver, Ray actors) write one run: the driver is primary, the others join with
`x_primary=False` and their own `x_label` (wandb's distributed-training guide, "track all processes to
a single run"). Offline, every process writes its own offline segment under the same run id;
`wandb sync <run_dir>/wandb/offline-run-*` uploads the segments of one run id into that run, in order
of start time.

The x-axis is the iteration: every record carries `iteration` and every metric is defined with
`step_metric="iteration"` (in shared mode wandb ignores `log(step=...)`). Outside shared mode the
driver also passes step=iteration, unless the run's step is already past it (a resumed run repeating
iterations after its last checkpoint; wandb would drop those records).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

PREFIXES = ("train", "rollout", "eval", "time", "report")


def _init(mode: str, run_id: str | None, project: str, directory: Path | None, *, primary: bool,
          label: str, name: str | None = None, config: dict | None = None):
    import wandb

    if mode == "online":
        settings = wandb.Settings(mode="shared", x_primary=primary, x_label=label,
                                  x_update_finish_state=primary, silent=True)
    else:
        settings = wandb.Settings(mode="offline", x_label=label, silent=True)
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project, id=run_id, name=name, config=config, resume="allow", reinit="create_new",
                     dir=str(directory) if directory is not None else None, settings=settings)
    run.define_metric("iteration")
    for prefix in PREFIXES:
        run.define_metric(f"{prefix}/*", step_metric="iteration")
    return run


def start_driver_run(run_dir: Path, mode: str, project: str, name: str | None = None, config: dict | None = None,
                     resume_id: str | None = None):
    """The driver's (primary) wandb run, or None when disabled. resume_id continues that run."""
    if mode == "disabled":
        return None
    return _init(mode, resume_id, project, Path(run_dir), primary=True, label="driver", name=name, config=config)


def join_shared_run(run_id: str, *, project: str = "spillover", mode: str = "offline", label: str | None = None,
                    directory: str | Path | None = None):
    """Join the driver's run `run_id` from another process (a Ray actor): returns a wandb Run or None.

    mode: the driver's tracking.wandb_mode. label names this writer (default: actor-<host>-<pid>).
    Log with `log_at_iteration(run, metrics, iteration)` and call `run.finish()` when the actor stops.
    """
    if mode == "disabled" or not run_id:
        return None
    _use_own_service()
    label = label or f"actor-{socket.gethostname()}-{os.getpid()}"
    return _init(mode, run_id, project, Path(directory) if directory else None, primary=False, label=label)


def _use_own_service() -> None:
    """Forget a wandb service inherited from another process (WANDB_SERVICE names the pid that started
    it): a Ray worker started after the driver's wandb.init inherits it, and that service refuses a second
    writer of the same run id ("run ID ... is in use")."""
    token = os.environ.get("WANDB_SERVICE", "")
    parts = token.split("-")
    if token and (len(parts) < 2 or parts[1] != str(os.getpid())):
        os.environ.pop("WANDB_SERVICE", None)


def log_at_iteration(run, metrics: dict[str, Any], iteration: int) -> None:
    """Log prefixed scalar metrics at `iteration` (the x-axis of every chart)."""
    if run is None:
        return
    record = {"iteration": int(iteration), **metrics}
    if not run.settings._shared and iteration >= run.step:
        run.log(record, step=int(iteration))
    else:
        run.log(record)


def log_images(run, images: dict[str, Path], iteration: int) -> None:
    """Attach PNG files (e.g. the report plots) to the run as images under report/."""
    if run is None or not images:
        return
    import wandb

    log_at_iteration(run, {f"report/{name}": wandb.Image(str(path)) for name, path in images.items()}, iteration)


def finish(run, exit_code: int = 0) -> None:
    if run is not None:
        run.finish(exit_code=exit_code)
