"""Ray's loopback settings, applied by `set_loopback_env()` at start-up (infra.cluster.init_ray calls it before
it starts a local Ray, whose processes read them when they start; tests call it first thing). Nothing here
runs at import."""
from __future__ import annotations

import os

# Without these a local Ray binds every interface and phones home; see MACHINE-NOTES.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # makes every Ray listener use 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def set_loopback_env() -> None:
    """Defaults only, and only for a local Ray: joining a cluster (RAY_ADDRESS) keeps Ray's own choice."""
    if os.environ.get("RAY_ADDRESS"):
        return
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
