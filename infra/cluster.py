"""Ray runtime: join RAY_ADDRESS (or a configured cluster), or start a local one bound to loopback."""
from __future__ import annotations

import os

import ray

from .ray_env import set_loopback_env


def init_ray(address: str | None = None, num_cpus: int | None = None, system_config: dict | None = None) -> dict:
    """Connect to `address` / RAY_ADDRESS, or start a local Ray on 127.0.0.1. Idempotent.

    Never uses address="auto": other Ray instances may run on the same machine. system_config: Ray's internal
    settings for a local start (ray.init's _system_config; a cluster that is joined keeps its own).
    """
    if ray.is_initialized():
        return {"address": "existing"}
    address = address or os.environ.get("RAY_ADDRESS") or None
    set_loopback_env(address)
    _reread_cluster_flag()
    if address:
        info = ray.init(address=address, log_to_driver=False)
    else:
        # Logical CPUs: engines and learners are mostly waiting on each other, so over-subscribe a bit
        # to keep fractional-CPU actors from starving plain tasks.
        # address="local": always a new local instance, never one that another process started on this machine
        info = ray.init(address="local", num_cpus=num_cpus or max(4, 2 * (os.cpu_count() or 1)),
                        include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                        _system_config=system_config)
    return {"address": info.address_info.get("address") if hasattr(info, "address_info") else str(info)}


def _reread_cluster_flag() -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at `import ray`, and this driver's value decides
    where the local instance listens (measured: with the import-time value, GCS, raylet, workers and agents
    bind every interface even though they start after set_loopback_env()). Read it again, with Ray's own
    parser, so it does not matter whether `ray` was imported before the loopback variables were set."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR,
                                                              not ray_constants.IS_WINDOWS_OR_OSX)
