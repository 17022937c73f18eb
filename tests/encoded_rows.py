"""Data-file rows as the bytes a stored file holds (JSON Lines, Parquet): what the Hub and S3 data tests upload."""
from __future__ import annotations

import io
import json


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()
