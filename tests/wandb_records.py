"""Read the records of an offline wandb run (<dir>/wandb/offline-run-*/run-<id>.wandb) for assertions.

The file is a LevelDB-style log (7-byte file header, 32 KiB blocks, records split into FULL / FIRST /
MIDDLE / LAST chunks) of wandb's `Record` protobufs."""
from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            return
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body


def read_run(path: Path) -> dict:
    """-> {"run_id", "history": [ {key: json value string} ... ]} of one offline segment."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"run_id": None, "history": []}
    for raw in _chunks(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"] = record.run.run_id
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): item.value_json
                                   for item in record.history.item})
    return out


def offline_segments(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))


def read_segments(directory: Path, count: int, timeout_s: float = 20.0) -> list[dict]:
    """The `count` offline segments under directory, once each has its run record (wandb's service process
    may still be writing a file for a moment after run.finish() returns)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        runs = [read_run(p) for p in offline_segments(directory)]
        if (len(runs) == count and all(r["run_id"] for r in runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)
