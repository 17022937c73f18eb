"""Prompt data: read and validate a JSONL prompt file, and the cursor that hands out prompt groups.

A group's id is its position in the prompt stream (unique across epochs); its data set index is
`order[position % N]` for the epoch's (seeded) shuffle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


@dataclass
class PromptSet:
    texts: list[str]
    labels: list[Any]
    tokens: list[list[int]]
    truncated_count: int = 0

    def __len__(self) -> int:
        return len(self.texts)


def jsonl_lines(path: str | Path, error: type[Exception], what: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines of a JSONL file, decoded as UTF-8 (a leading BOM is dropped).
    A line that is not UTF-8 (a binary, compressed or Latin-1 file) raises `error` naming the file, the line
    and the byte; `what` says which file it is (e.g. "a prompt file (data.prompts_path)")."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise error(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                            f"{what} must be UTF-8 JSON Lines, one JSON object per line (a binary or compressed "
                            "file? re-save it as UTF-8 text)") from None
            if line.strip():
                yield lineno, line


def parse_json_object(where: str, line: str, expected: str, error: type[Exception]) -> dict:
    """One JSONL line -> its object; `error` naming `where` (path:line) for bad JSON or a non-object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err.msg}); expected one JSON object with {expected} per line: "
                    "fix or remove that line") from None
    if not isinstance(row, dict):
        raise error(f"{where}: expected a JSON object with {expected}; got a JSON {_json_type(row)}")
    return row


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (number, array, object, ...)."""
    names = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _parse_line(path: str, lineno: int, line: str, prompt_key: str, label_key: str) -> tuple[str, Any]:
    row = parse_json_object(f"{path}:{lineno}", line, f"{prompt_key!r} and {label_key!r}", PromptFileError)
    for key, setting in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key not in row:
            raise PromptFileError(f"{path}:{lineno}: missing key {key!r} (set {setting} if the file uses "
                                  f"another name; keys present: {sorted(row)})")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        raise PromptFileError(f"{path}:{lineno}: {prompt_key!r} must be a string (the prompt text); got "
                              f"{_json_type(prompt)} {json.dumps(prompt)[:40]}")
    if not prompt.strip():
        raise PromptFileError(f"{path}:{lineno}: empty prompt under {prompt_key!r}; remove the line")
    return prompt, row[label_key]


def read_prompts(path: str | Path, tokenizer, max_prompt_tokens: int, prompt_key: str = "prompt",
                 label_key: str = "label", over_long: str = "refuse") -> PromptSet:
    """Read `path` (JSONL) and tokenize every prompt. Over-long prompts are refused (error naming the line)
    or, with over_long="truncate", cut to their last `max_prompt_tokens` tokens and counted."""
    path = str(path)
    if not Path(path).is_file():
        raise PromptFileError(f"prompt file {path!r} does not exist (data.prompts_path)")
    texts, labels = [], []
    for lineno, line in jsonl_lines(path, PromptFileError, "a prompt file (data.prompts_path)"):
        prompt, label = _parse_line(path, lineno, line, prompt_key, label_key)
        texts.append(prompt)
        labels.append(label)
    if not texts:
        raise PromptFileError(f"prompt file {path!r} holds no prompts")
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = 0
    for i, ids in enumerate(tokens):
        if len(ids) > max_prompt_tokens:
            if over_long != "truncate":
                raise PromptFileError(
                    f"{path}: prompt #{i + 1} has {len(ids)} tokens, more than the {max_prompt_tokens} allowed "
                    f"(rollout.max_model_len - rollout.max_tokens); shorten it, raise rollout.max_model_len, "
                    f"or set data.over_long_prompts=truncate")
            tokens[i] = ids[-max_prompt_tokens:]
            truncated += 1
    return PromptSet(texts, labels, [list(t) for t in tokens], truncated)


@dataclass
class PromptCursor:
    """Hands out prompt groups in a seeded order, epoch after epoch. State is JSON-able."""

    num_prompts: int
    seed: int = 0
    shuffle: bool = True
    position: int = 0
    loaded_iterations: list[int] = field(default_factory=list)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def dataset_indices(self, group_ids: np.ndarray) -> np.ndarray:
        """Stream positions -> data set indices. int[k] -> int[k]"""
        group_ids = np.asarray(group_ids, dtype=np.int64)
        out = np.empty_like(group_ids)
        epochs = group_ids // self.num_prompts
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._order(int(epoch))[group_ids[sel] % self.num_prompts]
        return out

    def take(self, count: int) -> np.ndarray:
        """The next `count` group ids (stream positions). -> int[count]"""
        ids = np.arange(self.position, self.position + count, dtype=np.int64)
        self.position += count
        return ids

    def state_dict(self) -> dict:
        return {"num_prompts": self.num_prompts, "seed": self.seed, "shuffle": self.shuffle,
                "position": self.position, "loaded_iterations": list(self.loaded_iterations)}

    @classmethod
    def from_state(cls, state: dict) -> "PromptCursor":
        return cls(**state)
