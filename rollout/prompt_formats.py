"""The built-in prompt-file formats (data.format; `python -m spillover.rollout.builtin.convert_data` writes them out):
GSM8K rows {"question", "answer": "...#### 72"} and MATH rows {"problem", "solution": "...\\boxed{...}", "level"?,
"type"?, "answer"?} -> {"prompt", "label", "id", ...} rows, as the prompt reader takes them."""
from __future__ import annotations


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
# the columns each format reads: (required, optional)
SOURCE_COLUMNS = {"gsm8k": (["question", "answer"], []), "math": (["problem", "solution"], ["answer", "level", "type"])}
