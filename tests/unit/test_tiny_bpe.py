"""The tiny model's BPE tokenizer (infra/tiny_bpe.py) and the arithmetic task (rollout/builtin/arith_task.py)."""
from __future__ import annotations

import pytest

from spillover.infra.tiny_bpe import build_bpe_tokenizer
from spillover.rollout.builtin.arith_task import generate_dataset, make_rows
from spillover.rollout.prompt_data import read_prompts


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer()


def test_trained_deterministically_and_round_trips_any_text(tok):
    assert build_bpe_tokenizer().get_vocab() == tok.get_vocab() and len(tok) == 512
    text = "The answer is \\boxed{19}.\n\nÜber 3 × 4 — ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges: fewer tokens than characters
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|endoftext|>", "left")


def test_arithmetic_prompts_render_as_the_chat_template_does(tok, tmp_path):
    rows = make_rows(50, seed=3)
    assert rows == make_rows(50, seed=3) and rows != make_rows(50, seed=4)
    for row in rows:
        a, op, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{a}{op}{b}")) == row["label"]  # noqa: S307 (digits and one operator)
    path = generate_dataset(tmp_path / "train.parquet", 50, seed=3)
    prompts = read_prompts(path, tok, 64, additional_keys=["id", "op"], system_prompt="Put the answer in \\boxed{}.")
    messages = [{"role": "system", "content": "Put the answer in \\boxed{}."}, rows[0]["prompt"][0]]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompts.tokens[0] == list(expected)
    assert prompts.texts[0].startswith("<|im_start|>system\n") and prompts.texts[0].endswith("<|im_start|>assistant\n")
    assert prompts.metadata[0] == {"id": "arith-0", "op": rows[0]["op"]}
    assert generate_dataset(path, 50, seed=3) == path  # the same rows: kept
