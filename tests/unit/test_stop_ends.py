"""Where a row ends when the engine did not end it (issue 37, item 3): SGLang matches stop strings in one request's
own output and may return, with an abort, the token that completes a stop string or an end token other than the
tokenizer's EOS. The driver's default hooks (rollout/drivers/rounds.py) and the dock's end ids
(spillover.infra.models.end_token_ids) end those rows instead of continuing them past their end."""
from __future__ import annotations

import json

import numpy as np
import pytest

from spillover.infra.models import build_char_tokenizer, end_token_ids
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.rounds import RoundHooks
from spillover.rollout.sglang.protocol import GenerateResponse


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def answer(ids: list[int], finish: str = "abort") -> GenerateResponse:
    return GenerateResponse.model_validate({"output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 2, "completion_tokens": len(ids),
        "weight_version": "0", "output_token_logprobs": [[-0.5, i, None] for i in ids]}})


def one_row_dock(end_ids) -> TransferDock:
    dock = TransferDock(1, 1, 4, 32, 64, end_ids)
    dock.load_groups(np.asarray([0]), [[5, 6]], ["label"])
    return dock


def test_a_stop_string_split_by_a_cut_ends_the_row_at_the_token_that_completes_it(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    dock = one_row_dock([int(tok.eos_token_id)])
    hooks = RoundHooks(dock, 0, stop=["=+"], decode=tok.decode)
    rows = dock.take_rows()
    hooks.on_answers(rows, [answer(enc("1+2="))], stopping=True)  # cut after '=' (SGLang saw no '=+')
    assert not dock.complete[0] and dock.responses.length[0] == 4
    rows = dock.take_rows()  # continued: the engine's output starts with '+', which completes '=+' across the cut
    kept = hooks.on_answers(rows, [answer(enc("+3 and on"), finish="length")], stopping=False)
    assert kept == 1 and dock.complete[0] and dock.stopped[0]
    assert tok.decode(dock.responses.gather(np.asarray([0]), "tokens").tolist()) == "1+2=+"


def test_a_split_stop_string_ends_the_row_also_when_the_engine_stopped_later_on_its_own(tok):
    """The engine cannot see the split '=+', runs on and ends at an EOS: the row still ends at the '+'."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    dock = one_row_dock([int(tok.eos_token_id)])
    hooks = RoundHooks(dock, 0, stop=["=+"], decode=tok.decode)
    hooks.on_answers(dock.take_rows(), [answer(enc("1+2="))], stopping=True)
    kept = hooks.on_answers(dock.take_rows(), [answer(enc("+3 and on") + [int(tok.eos_token_id)], finish="stop")],
                            stopping=False)
    assert kept == 1 and dock.complete[0] and dock.stopped[0]
    assert tok.decode(dock.responses.gather(np.asarray([0]), "tokens").tolist()) == "1+2=+"


def test_an_aborted_answer_whose_last_token_completes_a_stop_string_ends_the_row(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    dock = one_row_dock([int(tok.eos_token_id)])
    hooks = RoundHooks(dock, 0, stop=["=+"], decode=tok.decode)
    hooks.on_answers(dock.take_rows(), [answer(enc("1=+"))], stopping=True)
    assert dock.complete[0] and dock.stopped[0] and dock.responses.length[0] == 3
    other = one_row_dock([int(tok.eos_token_id)])  # no stop string in it: the aborted row is carried over
    RoundHooks(other, 0, stop=["=+"], decode=tok.decode).on_answers(other.take_rows(), [answer(enc("1+="))], True)
    assert not other.complete[0] and other.responses.length[0] == 3


def test_stop_strings_without_a_decode_are_refused():
    with pytest.raises(ValueError, match="rollout.stop"):
        RoundHooks(one_row_dock([0]), 0, stop=["x"])


def test_every_end_token_of_the_model_ends_a_row_cut_by_an_abort(tmp_path, tok):
    """Qwen2.5-Instruct's tokenizer ends on <|im_end|>; its config also lists <|endoftext|>. An aborted answer whose
    last token is the second one is complete, not continued past its end."""
    eos, other_end = int(tok.eos_token_id), 40
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, other_end]}))
    ends = end_token_ids(tmp_path, tok)
    assert ends == tuple(sorted({eos, other_end}))
    dock = one_row_dock(ends)
    RoundHooks(dock, 0).on_answers(dock.take_rows(), [answer([12, 13, other_end])], stopping=True)
    assert dock.complete[0] and dock.stopped[0]


def test_a_final_stop_string_split_by_a_cut_ends_a_multi_turn_row(tok):
    """Multi-turn rows (rollout/drivers/tool_turns.py ToolTurns.on_answer) end where a rollout.stop string completes
    across the cut, as single-turn rows do. No env runs: no tool call starts."""
    from spillover.infra.config.rollout import RolloutConfig
    from spillover.rollout.drivers.tool_turns import ToolTurns

    enc = lambda s: tok.encode(s, add_special_tokens=False)
    cfg = RolloutConfig(global_batch_size=1, n_samples_per_prompt=2, max_tokens=32, max_model_len=64, max_split=4,
                        env_path="spillover.rollout.builtin.calculator.CalculatorEnv", tool_call_stop=["=+"],
                        stop=["!?"])
    dock = TransferDock.from_config(cfg, [int(tok.eos_token_id)])
    dock.load_groups(np.asarray([0]), [[5, 6]], ["label"])
    hooks = ToolTurns(dock, 0, cfg, envs=None, tokenizer=tok, loop=None)
    rows = dock.take_rows()  # the group's two rows
    hooks.on_answers(rows, [answer(enc("ab!")), answer(enc("xy"))], stopping=True)  # cut after '!': no '!?' yet
    assert not dock.complete[0]
    kept = hooks.on_answers(dock.take_rows()[:1], [answer(enc("?cd=+"), finish="length")], stopping=False)
    assert kept == 1 and dock.complete[0] and dock.stopped[0] and not dock.awaiting_tool[0]
    assert tok.decode(dock.responses.gather(np.asarray([0]), "tokens").tolist()) == "ab!?"
