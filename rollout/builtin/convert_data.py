"""Convert GSM8K- and MATH-format JSONL files into spillover prompt files (JSON Lines or Parquet).

    python -m spillover.rollout.builtin.convert_data gsm8k train.jsonl data/gsm8k/train.parquet
    python -m spillover.rollout.builtin.convert_data math  train.jsonl data/math/train.parquet

GSM8K rows {"question", "answer": "...#### 72"} -> {"prompt": question, "label": "72", "id": "gsm8k-<line>"}.
MATH rows {"problem", "solution": "...\\boxed{...}", "level"?, "type"?} -> {"prompt": problem, "label": the last
boxed answer of the solution, "id", "level", "type"}. Prompts stay text: the recipes render them as chat with
data.apply_chat_template and data.system_prompt (configs/gpu/). Keep "id" (and "level", "type") with
data.additional_keys to see them in the reward function and debug data.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..prompt_formats import CONVERTERS, ConvertError
from ..prompt_data import jsonl_lines, parse_json_object


def convert(kind: str, src: str | Path, dst: str | Path) -> int:
    """Convert every row of src (JSONL) into dst (.parquet, else JSONL) -> rows written."""
    fn, expected = CONVERTERS[kind]
    rows = [fn(parse_json_object(f"{src}:{n}", line, expected, ConvertError), f"{src}:{n}", n)
            for n, line in jsonl_lines(src, ConvertError, f"a {kind} file")]
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), dst)
    else:
        dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillover.rollout.builtin.convert_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(CONVERTERS))
    parser.add_argument("src", help="input JSONL")
    parser.add_argument("dst", help="output file (.parquet or .jsonl)")
    args = parser.parse_args(argv)
    try:
        count = convert(args.kind, args.src, args.dst)
    except (ConvertError, FileNotFoundError) as err:
        print(f"convert_data: {err}", file=sys.stderr)
        return 2
    print(f"{count} prompts -> {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
