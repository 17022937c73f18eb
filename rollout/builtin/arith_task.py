"""The built-in arithmetic task (data.builtin_task=arithmetic): chat-message prompts "What is a + b?" with the
value as label, written as Parquet, for the math-verify reward (configs/tiny-math.yaml).

Each row: prompt = [{"role": "user", "content": "What is 12 + 7?"}], label = "19", id = "arith-<i>", op = "+".
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

OPS = ("+", "-", "*")


def make_rows(count: int, seed: int = 0, max_operand: int = 99) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
        op = OPS[int(rng.integers(0, len(OPS)))]
        if op == "*":
            b = b % 10  # products stay short
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}], "label": str(value),
                     "id": f"arith-{i}", "op": op})
    return rows


def generate_dataset(path: str | Path, count: int, seed: int = 0) -> Path:
    """Write `count` arithmetic prompts to `path` (Parquet); kept when it already holds the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    rows = make_rows(count, seed)
    if path.is_file():
        try:
            if pq.read_table(path).to_pylist() == rows:
                return path
        except pa.ArrowException:
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
