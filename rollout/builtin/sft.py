"""SFT mode: a rollout function that reads pre-generated samples instead of generating them.

Set `rollout.rollout_function_path=spillover.rollout.builtin.sft.generate_sft_rollout` and `data.sft_path` to a JSONL file
whose lines are either {"prompt": str, "response": str} or {"prompt_tokens": [int], "response_tokens":
[int]}, each with an optional "loss_mask" (0/1 per response token) and "label".

A group is ONE sample (one line): SFT has no group baseline, so copies would only repeat the same
gradient. Rollout `rollout_id` returns GBS groups, lines [rollout_id * GBS, (rollout_id + 1) * GBS) of
the file in file order, wrapping around at its end (group_index = that stream position).

Text rows are tokenized with the run's tokenizer (`data_source.tokenizer`, else the tokenizer of
model.path), prompt and response separately and without special tokens, exactly as RL prompts are;
the tokenizer's EOS is appended to a text response (always trained) so the model learns to stop. A
loss_mask on a text row covers the response as written, before that EOS. Token rows are taken as is.

How the flow trains on them (samples carry metadata {"sft": True}, see rollout/batch.py `is_sft_batch`):
  * skip the reward step's group advantages (a group of one has none): advantage = 1 for every token;
  * compute old logprobs with the learner (never take them from the samples: their rollout_logprobs
    are placeholders, 0.0, and weight_versions are SFT_WEIGHT_VERSION = -1, "no policy made this");
  * no TIS (there is no behaviour policy), no KL unless wanted.
Then ratio = exp(logp - old) = 1 at the step's first (and, for one update per rollout, only) pass, and
the clipped loss -A * ratio has gradient -grad(logp): the NLL gradient (tests/unit/test_sft.py).
With grpo.num_steps_per_rollout > 1 the later steps see ratio != 1 and PPO clipping applies to them.
Note the config check `micro_batch_size divides the samples of one step`: an SFT batch has GBS samples.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..prompt_data import jsonl_lines, parse_json_object
from ..batch import SFT_KEY
from ..sample import Sample, Status

SFT_WEIGHT_VERSION = -1


class SFTDataError(ValueError):
    """An SFT sample file that cannot be used; the message names the file, the line and the fix."""


def generate_sft_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """RunConfig, rollout id -> GBS groups of one SFT sample each, from data.sft_path (see module doc)."""
    if evaluation:
        raise SFTDataError("the SFT rollout function has no eval mode; set rollout.eval_function_path to a "
                           "generating function (e.g. spillover.rollout.drivers.default_rollout.generate_rollout) or turn eval off")
    path = args.data.sft_path
    if not path:
        raise SFTDataError("SFT mode needs data.sft_path: a JSONL file of {prompt, response} or "
                           "{prompt_tokens, response_tokens} rows")
    lines = read_sft_lines(path)
    tokenizer = getattr(data_source, "tokenizer", None) or _run_tokenizer(args)
    gbs = args.rollout.global_batch_size
    groups = []
    for position in range(rollout_id * gbs, (rollout_id + 1) * gbs):
        lineno, line = lines[position % len(lines)]
        sample = parse_sft_row(path, lineno, line, tokenizer, group_index=position)
        total = len(sample.prompt_tokens) + sample.response_length
        if total > args.rollout.max_model_len:
            raise SFTDataError(f"{path}:{lineno}: prompt + response is {total} tokens, more than "
                               f"rollout.max_model_len ({args.rollout.max_model_len}); shorten the row or raise it")
        groups.append([sample])
    return groups


def read_sft_lines(path: str | Path) -> list[tuple[int, str]]:
    """(line number, text) of the non-empty lines of a JSONL file."""
    p = Path(path)
    if not p.is_file():
        raise SFTDataError(f"SFT sample file {str(p)!r} does not exist (data.sft_path)")
    lines = list(jsonl_lines(p, SFTDataError, "an SFT sample file (data.sft_path)"))
    if not lines:
        raise SFTDataError(f"SFT sample file {str(p)!r} holds no rows (data.sft_path)")
    return lines


def parse_sft_row(path, lineno: int, line: str, tokenizer, group_index: int) -> Sample:
    """One JSONL line -> a COMPLETED Sample with metadata {"sft": True, "sft_line": lineno}."""
    where = f"{path}:{lineno}"
    row = parse_json_object(where, line, "prompt/response or prompt_tokens/response_tokens", SFTDataError)
    if "prompt_tokens" in row or "response_tokens" in row:
        prompt_ids = _token_list(row, "prompt_tokens", where)
        response_ids = _token_list(row, "response_tokens", where)
        prompt, response, eos = "", "", []
    elif "prompt" in row and "response" in row:
        prompt, response = _text(row, "prompt", where), _text(row, "response", where)
        prompt_ids, response_ids = tokenizer([prompt, response], add_special_tokens=False)["input_ids"]
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    else:
        raise SFTDataError(f"{where}: needs 'prompt' and 'response' (text) or 'prompt_tokens' and "
                           f"'response_tokens' (ids); keys present: {sorted(row)}")
    mask = _loss_mask(row.get("loss_mask"), len(response_ids), where)
    response_ids = list(response_ids) + eos
    if mask is not None:
        mask += [1] * len(eos)
    n = len(response_ids)
    return Sample(group_index=group_index, index=0, prompt_tokens=list(prompt_ids), response_tokens=response_ids,
                  rollout_logprobs=[0.0] * n, weight_versions=[SFT_WEIGHT_VERSION] * n, loss_mask=mask,
                  reward=0.0, label=row.get("label"), prompt=prompt, response=response, status=Status.COMPLETED,
                  metadata={SFT_KEY: True, "sft_line": lineno})


def _text(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str) or not value:
        raise SFTDataError(f"{where}: {key!r} must be a non-empty string")
    return value


def _token_list(row: dict, key: str, where: str) -> list[int]:
    value = row.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in value):
        raise SFTDataError(f"{where}: {key!r} must be a non-empty list of token ids (ints >= 0); a token row "
                           "needs both prompt_tokens and response_tokens")
    return list(value)


def _loss_mask(value: Any, length: int, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or any(v not in (0, 1) or isinstance(v, float) for v in value):
        raise SFTDataError(f"{where}: 'loss_mask' must be a list of 0/1")
    if len(value) != length:
        raise SFTDataError(f"{where}: 'loss_mask' has {len(value)} entries but the response has {length} tokens")
    return [int(v) for v in value]


def _run_tokenizer(args):
    from ...infra.models import load_tokenizer, resolve_model_path

    # the same max_position as flows/setup.py, so an existing tiny model is found, not rebuilt
    return load_tokenizer(resolve_model_path(args.model, args.run_dir, max(512, args.rollout.max_model_len)))
