"""Checkpoint names and the listing of a checkpoint location: what is there and which are complete, without
reading any (infra/storage/checkpoint.py reads and writes them). Light to import: `spillover resume` asks it before
anything else starts."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .store import Store, open_store

MANIFEST = "manifest.json"  # written last: a checkpoint with one is complete
_NAME = re.compile(r"^ckpt-(\d{8,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    iteration: int
    name: str       # "ckpt-00000012"
    complete: bool  # has a manifest (its objects are verified only when loaded)


def checkpoint_name(iteration: int) -> str:
    return f"ckpt-{iteration:08d}"


def list_checkpoints(store: Store) -> list[CheckpointInfo]:
    """Checkpoint prefixes under the store root, oldest first."""
    out = []
    for name in store.list():
        match = _NAME.match(name)
        if match:
            out.append(CheckpointInfo(int(match.group(1)), name, store.exists(f"{name}/{MANIFEST}")))
    return sorted(out, key=lambda info: info.iteration)


def checkpoint_url(cfg) -> str:
    """Where a run (a RunConfig) checkpoints: storage.url, else <run_dir>/checkpoints."""
    return cfg.storage.url or str(Path(cfg.run_dir).resolve() / "checkpoints")


def newest_complete_checkpoint(cfg) -> int | None:
    """The iteration of the run's newest complete checkpoint (None: none yet)."""
    done = [c.iteration for c in list_checkpoints(open_store(checkpoint_url(cfg), cfg.storage)) if c.complete]
    return max(done) if done else None
