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

from spillover.rollout.prompt_data import jsonl_lines, parse_json_object


class ConvertError(ValueError):
    """An input row that cannot be converted; the message names the file and line."""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None


def convert_gsm8k(row: dict, where: str, index: int) -> dict:
    question, answer = _text(row, "question", where), _text(row, "answer", where)
    if "####" not in answer:
        raise ConvertError(f"{where}: 'answer' has no '#### <number>' final line")
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not label:
        raise ConvertError(f"{where}: nothing after '####' in 'answer'")
    return {"prompt": question, "label": label, "id": f"gsm8k-{index}"}


def convert_math(row: dict, where: str, index: int) -> dict:
    problem, solution = _text(row, "problem", where), _text(row, "solution", where)
    label = row.get("answer") if isinstance(row.get("answer"), str) else last_boxed(solution)
    if not label:
        raise ConvertError(f"{where}: 'solution' holds no \\boxed{{...}} answer (and there is no 'answer' key)")
    return {"prompt": problem, "label": label, "id": f"math-{index}", "level": str(row.get("level", "")),
            "type": str(row.get("type", ""))}


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConvertError(f"{where}: {key!r} must be non-empty text; keys present: {sorted(row)}")
    return value


CONVERTERS = {"gsm8k": (convert_gsm8k, "'question' and 'answer'"), "math": (convert_math, "'problem' and 'solution'")}


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
