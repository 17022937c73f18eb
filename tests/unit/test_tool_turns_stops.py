"""Multi-turn rows (rollout/drivers/tool_turns.py ToolTurns.on_answer) end where a rollout.stop string completes across
a partial-rollout cut, as single-turn rows do (tests/unit/test_stop_ends.py): the engine cannot see a string split by
the cut. No env or engine runs: the answers are SGLang-shaped and no tool call starts."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.infra.models import build_char_tokenizer
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.tool_turns import ToolTurns
from spillover.rollout.sglang.protocol import GenerateResponse


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def answer(ids: list[int], finish: str = "abort") -> GenerateResponse:
    return GenerateResponse.model_validate({"output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 2, "completion_tokens": len(ids),
        "weight_version": "0", "output_token_logprobs": [[-0.5, i, None] for i in ids]}})


def test_a_final_stop_string_split_by_a_cut_ends_a_multi_turn_row(tok):
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
