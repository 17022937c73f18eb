"""Ray's loopback settings, applied by `set_loopback_env()` at start-up (spillover.infra.cluster.init_ray calls it before
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


def is_loopback_address(address: str) -> bool:
    """'127.0.0.1:6379', 'localhost:6379', 'ray://127.0.0.1:10001' -> True."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def set_loopback_env(address: str | None = None) -> None:
    """Defaults only, for a local Ray or a cluster on this machine's loopback (`address`, else RAY_ADDRESS): joining
    another cluster keeps Ray's own choice. Without them a driver swaps a 127.0.0.1 address for the host's and
    never reaches a loopback-only cluster (it retries for minutes)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address and not is_loopback_address(address):
        return
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
