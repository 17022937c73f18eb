"""Read what an offline wandb run recorded (<dir>/wandb/offline-run-*/run-<id>.wandb), for assertions.

wandb's own reader does the parsing: `wandb leet inspect PATH --json --follow` prints each record of the
transaction log as one JSON line and returns once the run's exit record is written (wandb's writer may still
be busy for a moment after run.finish() returns), or after an idle timeout.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from waiting import wait_for


def _flat(item: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": "1"}: leaf values as JSON text, nested keys joined by '/' (wandb's own
    nested-key notation, e.g. an image logged under report/reward has report/reward/_type)."""
    out = {}
    for key, value in item.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}/"))
        else:
            out[name] = json.dumps(value)
    return out


def read_run(path: Path, idle_timeout_s: int = 20) -> dict:
    """-> {"run_id", "exited", "history": [{key: JSON value text} ...]} of one offline segment."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(path), "--json", "--follow",
                           "--idle-timeout", f"{idle_timeout_s}s"],
                          capture_output=True, text=True, timeout=idle_timeout_s + 60)
    if proc.returncode:
        raise RuntimeError(f"wandb leet inspect {path} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = {"run_id": None, "exited": False, "history": []}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        kind = record.get("type")
        if kind == "run":
            out["run_id"] = record["run"]["run_id"]
        elif kind == "history":
            out["history"].append(_flat(record["history"].get("item", {})))
        elif kind == "exit":
            out["exited"] = True
    return out


def offline_segments(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))


def read_segments(directory: Path, count: int, timeout_s: float = 20.0) -> list[dict]:
    """The records of the `count` offline segments under directory (each read to its exit record)."""
    paths = wait_for(lambda: offline_segments(directory), timeout_s, f"{count} offline wandb segments",
                     until=lambda found: len(found) >= count)  # the segment files appear at wandb.init
    with ThreadPoolExecutor(max_workers=max(1, len(paths))) as pool:  # one wandb reader process per segment
        return list(pool.map(lambda p: read_run(p, idle_timeout_s=int(timeout_s)), paths))
