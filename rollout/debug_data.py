"""Debug rollout data: save a rollout's samples, and replay them later instead of generating.

A path template holds `{rollout_id}` and is a local path, file:// URL or s3:// URL (storage.save_debug_rollout_data
/ storage.load_debug_rollout_data). One Parquet file per rollout (never pickle), one row per sample:

  group (position of its group in the rollout), group_index, index: int64
  prompt_tokens, response_tokens, weight_versions: list<int64>; loss_mask: list<int64> or null
  rollout_logprobs: list<float64>; reward: float64 or null (NaN stays NaN)
  prompt, response, status: string; label, metadata: JSON text (metadata["data"]: the group's data.additional_keys)

Every value round-trips exactly, so a replay gives the same training batch (`RolloutBatch.from_samples`).
"""
from __future__ import annotations

import json
import posixpath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..infra.config.run_config import StorageConfig
from ..infra.storage.store import ObjectMissing, Store, open_store
from .sample import Sample

FORMAT = b"spillover.debug_rollout_data.v1"

SCHEMA = pa.schema([
    ("group", pa.int64()), ("group_index", pa.int64()), ("index", pa.int64()),
    ("prompt_tokens", pa.list_(pa.int64())), ("response_tokens", pa.list_(pa.int64())),
    ("rollout_logprobs", pa.list_(pa.float64())), ("weight_versions", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.int64())), ("reward", pa.float64()),
    ("prompt", pa.string()), ("response", pa.string()), ("status", pa.string()),
    ("label", pa.string()), ("metadata", pa.string()),
], metadata={b"format": FORMAT})


class DebugDataError(ValueError):
    """Debug rollout data that cannot be written or read; the message names the URL and the fix."""


def debug_data_url(template: str, rollout_id: int, setting: str = "storage.load_debug_rollout_data") -> str:
    """The template with {rollout_id} filled in."""
    if "{rollout_id}" not in (template or ""):
        raise DebugDataError(f"{setting}={template!r} must contain {{rollout_id}}, e.g. "
                             "s3://bucket/run/debug/rollout_{rollout_id}.parquet")
    try:
        return template.format(rollout_id=rollout_id)
    except (KeyError, IndexError, ValueError) as err:
        raise DebugDataError(f"{setting}={template!r}: only {{rollout_id}} may appear in braces ({err!r})") from None


def _store_and_key(url: str, store_options: StorageConfig | None) -> tuple[Store, str]:
    """'s3://bucket/dir/f.parquet' -> (Store of s3://bucket/dir, 'f.parquet'); local paths likewise."""
    scheme, sep, rest = url.partition("://") if "://" in url else ("", "", url)
    parent, name = posixpath.split(rest)
    if not name or (scheme and scheme != "file" and not parent):
        raise DebugDataError(f"debug rollout data URL {url!r} names no file; use e.g. "
                             "s3://bucket/debug/rollout_{rollout_id}.parquet or debug/rollout_{rollout_id}.parquet")
    return open_store(f"{scheme}{sep}{parent or '.'}" if scheme else (parent or "."), store_options), name


def save_debug_rollout_data(template: str, rollout_id: int, groups: list[list[Sample]],
                            store_options: StorageConfig | None = None) -> str:
    """Write the rollout's groups to template.format(rollout_id=...) as Parquet. -> the URL written."""
    url = debug_data_url(template, rollout_id, "storage.save_debug_rollout_data")
    store, key = _store_and_key(url, store_options)
    rows = [_row(g, s) for g, group in enumerate(groups) for s in group]
    table = pa.Table.from_pylist(rows, schema=SCHEMA.with_metadata({b"format": FORMAT,
                                                                     b"rollout_id": str(rollout_id).encode()}))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    store.put_bytes(key, sink.getvalue().to_pybytes())
    return store.key_url(key)


def load_debug_rollout_data(template: str, rollout_id: int,
                            store_options: StorageConfig | None = None) -> list[list[Sample]]:
    """Read the groups saved for `rollout_id` (in the order and grouping they were saved)."""
    url = debug_data_url(template, rollout_id)
    store, key = _store_and_key(url, store_options)
    try:
        data = store.get_bytes(key)
    except ObjectMissing:
        raise DebugDataError(f"no debug rollout data for rollout {rollout_id} at {store.key_url(key)} "
                             "(storage.load_debug_rollout_data); save it first with "
                             "storage.save_debug_rollout_data or fix the template") from None
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as err:
        raise DebugDataError(f"{store.key_url(key)} is not a Parquet file of debug rollout data ({err})") from None
    if (table.schema.metadata or {}).get(b"format") != FORMAT:
        raise DebugDataError(f"{store.key_url(key)} is not debug rollout data written by spillover "
                             f"(no {FORMAT.decode()} marker)")
    groups: list[list[Sample]] = []
    last = None
    for row in table.to_pylist():
        if row["group"] != last:
            groups.append([])
            last = row["group"]
        groups[-1].append(_sample(row))
    return groups


def _row(group: int, s: Sample) -> dict[str, Any]:
    d = s.to_dict()
    try:
        d["label"], d["metadata"] = json.dumps(d["label"]), json.dumps(d["metadata"])
    except TypeError as err:
        raise DebugDataError(f"sample {s.group_index}/{s.index}: label and metadata must be JSON values to be "
                             f"saved as debug rollout data ({err})") from None
    return {"group": group, **d}


def _sample(row: dict[str, Any]) -> Sample:
    row = dict(row)
    del row["group"]
    row["label"], row["metadata"] = json.loads(row["label"]), json.loads(row["metadata"])
    return Sample.from_dict(row)
