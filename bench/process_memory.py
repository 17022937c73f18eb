"""Peak resident memory of this process (Linux): reset it before a region, read it after (bench/weight_sync.py reads
it inside the learner and engine actors)."""
from __future__ import annotations

__all__ = ["peak_rss_bytes", "reset_peak_rss"]


def reset_peak_rss() -> int:
    """Reset this process's peak resident set (/proc/self/clear_refs 5); returns the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set since the last reset_peak_rss (VmHWM), in bytes."""
    return _status_bytes("VmHWM")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
