"""Prompt data: read and validate a prompt file (JSON Lines or Parquet), and the cursor that hands out prompt groups.

A group's id is its position in the prompt stream (unique across epochs); its data set index is
`order[position % N]` for the epoch's (seeded) shuffle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .chat import ChatPromptError, check_prompt, render_messages, to_messages
from ..infra.data_files import DataFile, data_file


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


@dataclass
class PromptSet:
    texts: list[str]
    labels: list[Any]
    tokens: list[list[int]]
    truncated_count: int = 0
    metadata: list[dict] | None = None  # data.additional_keys per prompt; None without additional keys

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


PARQUET_MAGIC = b"PAR1"


def is_parquet(path: str | Path) -> bool:
    """A Parquet file starts with PAR1 (whatever its name)."""
    with open(path, "rb") as fh:
        return fh.read(4) == PARQUET_MAGIC


def prompt_rows(path: str | DataFile, keys: list[str], optional: list[str] = ()) -> Iterator[tuple[str, dict]]:
    """("path:line" or "path row N", row) of a JSONL or Parquet prompt file. Parquet rows hold only `keys` and
    those of `optional` the file has (the columns read); a missing key column is one error naming the file and the
    columns present."""
    if not is_parquet(path):
        expected = " and ".join(repr(k) for k in keys[:2])
        for lineno, line in jsonl_lines(path, PromptFileError, "a prompt file (data.prompts_path)"):
            yield f"{path}:{lineno}", parse_json_object(f"{path}:{lineno}", line, expected, PromptFileError)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise PromptFileError(f"{path}: not a readable Parquet file ({err}); re-write it, or give JSON Lines") from None
    present = parquet.schema_arrow.names
    missing = [k for k in dict.fromkeys(keys) if k not in present]
    if missing:
        raise PromptFileError(f"{path}: no column {missing[0]!r} (set data.prompt_key, data.label_key or "
                              f"data.additional_keys to the file's names; columns: {present})")
    columns = list(dict.fromkeys([*keys, *(k for k in optional if k in present)]))
    row = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=columns):
        for values in batch.to_pylist():
            row += 1
            yield f"{path} row {row}", values
    if row == 0:
        raise PromptFileError(f"prompt file {path!r} holds no prompts")


def _parse_row(where: str, row: dict, keys: "PromptKeys") -> tuple[str | list, Any, dict | None]:
    for key, setting in [(keys.prompt, "data.prompt_key"), (keys.label, "data.label_key")] + [
            (k, "data.additional_keys") for k in keys.additional]:
        if key not in row:
            raise PromptFileError(f"{where}: missing key {key!r} (set {setting} if the file uses another name; "
                                  f"keys present: {sorted(row)})")
    try:
        prompt = check_prompt(row[keys.prompt], keys.prompt)
    except ChatPromptError as err:
        raise PromptFileError(f"{where}: {err}") from None
    metadata = {k: row[k] for k in keys.additional} if keys.additional else None
    try:  # labels and metadata go into checkpoints and debug data as JSON
        json.dumps([row[keys.label], metadata], allow_nan=False)
    except (TypeError, ValueError) as err:
        raise PromptFileError(f"{where}: the label {keys.label!r} and data.additional_keys values must be JSON "
                              f"values (text, numbers, lists, objects): {err}") from None
    return prompt, row[keys.label], metadata


@dataclass(frozen=True)
class PromptKeys:
    prompt: str = "prompt"
    label: str = "label"
    additional: tuple[str, ...] = ()


def read_prompts(path: str | Path | DataFile, tokenizer, max_prompt_tokens: int, prompt_key: str = "prompt",
                 label_key: str = "label", over_long: str = "refuse", additional_keys=(),
                 system_prompt: str | None = None, apply_chat_template: bool = False,
                 row_format: str = "prompt_label") -> PromptSet:
    """Read `path` (JSON Lines, or Parquet) and tokenize every prompt. A prompt is a string or a list of chat
    messages; messages (and, with apply_chat_template, strings as one user message) are rendered by the
    tokenizer's chat template, with system_prompt first (spillover.rollout.chat). Over-long prompts are refused (error
    naming the line) or, with over_long="truncate", cut to their last `max_prompt_tokens` tokens and counted.
    row_format (data.format): gsm8k or math rows are converted on read (spillover.rollout.prompt_formats) into
    prompt / label / id rows; the keys are then those. path: a local path, file:// URL or Hub file
    (spillover.infra.data_files), named as given in every message."""
    path = data_file(path)
    if not Path(path).is_file():
        raise PromptFileError(f"prompt file {path!r} does not exist (data.prompts_path)")
    if row_format != "prompt_label":
        prompt_key, label_key = "prompt", "label"
    keys = PromptKeys(prompt_key, label_key, tuple(additional_keys))
    texts, labels, metadata, wheres, chats = [], [], [], [], []
    for where, row in formatted_rows(path, row_format, [prompt_key, label_key, *keys.additional]):
        prompt, label, meta = _parse_row(where, row, keys)
        if isinstance(prompt, str) and system_prompt and not apply_chat_template:
            raise PromptFileError(f"{where}: data.system_prompt is set but this prompt is plain text and "
                                  "data.apply_chat_template is false; set data.apply_chat_template=true to render "
                                  "text prompts as chat, or drop data.system_prompt")
        if not isinstance(prompt, str) or apply_chat_template:
            chats.append((len(texts), to_messages(prompt, system_prompt)))
        texts.append(prompt)
        labels.append(label)
        metadata.append(meta)
        wheres.append(where)
    if not texts:
        raise PromptFileError(f"prompt file {path!r} holds no prompts")
    for i, messages in chats:  # one at a time, so an error names its line
        try:
            texts[i] = render_messages(tokenizer, [messages])[0]
        except ChatPromptError as err:
            raise PromptFileError(f"{wheres[i]}: {err}") from None
        except Exception as err:  # the template's own refusal (e.g. "roles must alternate"), which names no line
            raise PromptFileError(f"{wheres[i]}: the model's chat template refused this conversation "
                                  f"({type(err).__name__}: {err}); change the messages to what it accepts") from None
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = 0
    for i, ids in enumerate(tokens):
        if len(ids) > max_prompt_tokens:
            if over_long != "truncate":
                raise PromptFileError(
                    f"{wheres[i]}: prompt #{i + 1} has {len(ids)} tokens, more than the {max_prompt_tokens} allowed "
                    f"(rollout.max_model_len - rollout.max_tokens); shorten it, raise rollout.max_model_len, "
                    f"or set data.over_long_prompts=truncate")
            tokens[i] = ids[-max_prompt_tokens:]
            truncated += 1
    return PromptSet(texts, labels, [list(t) for t in tokens], truncated,
                     metadata if keys.additional else None)


def formatted_rows(path: str | DataFile, row_format: str, keys: list[str]) -> Iterator[tuple[str, dict]]:
    """prompt_rows, converted from a built-in format (data.format) when one is named."""
    if row_format == "prompt_label":
        yield from prompt_rows(path, keys)
        return
    from .prompt_formats import CONVERTERS, SOURCE_COLUMNS, ConvertError

    convert = CONVERTERS[row_format][0]
    required, optional = SOURCE_COLUMNS[row_format]
    for index, (where, row) in enumerate(prompt_rows(path, required, optional), start=1):
        try:
            yield where, convert(row, where, index)
        except ConvertError as err:
            raise PromptFileError(f"{err} (data.format={row_format}; data.format=prompt_label reads prompt/label "
                                  "rows)") from None


def read_prompt_file(path: str | Path | DataFile, tokenizer, data_cfg, max_prompt_tokens: int) -> PromptSet:
    """read_prompts with the settings of an spillover.infra.config.run_config.DataConfig."""
    return read_prompts(path, tokenizer, max_prompt_tokens, data_cfg.prompt_key, data_cfg.label_key,
                        data_cfg.over_long_prompts, data_cfg.additional_keys, data_cfg.system_prompt,
                        data_cfg.apply_chat_template, data_cfg.format)


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


def groups_for_iteration(dock, num_iterations: int) -> int:
    """Groups to load now: every free dock slot, capped so that no more than num_iterations x GBS groups are ever
    loaded (the dock counts its loads in next_load_seq, which its snapshots keep).

    Filling the free slots, not loading GBS a time, is what keeps partial rollout on: the dock holds its capacity
    (2 x GBS with partial rollout, + over-sampling groups) at the start and, once it trained GBS, gets GBS back; a
    dock that holds fewer (emptied by the last iteration's drain, then a run resumed with more iterations) is filled
    again, as at the start. A dock of only GBS groups must finish every row, so nothing would ever be cut again.

    With the cap the dock holds >= GBS groups in every iteration and exactly GBS in the last one (it drains), so
    exactly num_iterations x GBS groups are loaded and each is trained once. Without over-sampling this is 2 x GBS,
    then GBS, then none in the last iteration of a partial-rollout run.
    """
    remaining = num_iterations * dock.gbs - int(dock.next_load_seq)
    return max(0, min(dock.free_group_slots(), remaining))
