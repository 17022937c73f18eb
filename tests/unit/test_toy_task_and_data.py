import json

import numpy as np
import pytest

from spillover.rollout.builtin import toy_task
from spillover.rollout.prompt_data import PromptCursor, PromptFileError, read_prompts


def test_reward_and_baseline():
    assert toy_task.reward("aaa", 3) == 1.0 and toy_task.reward("", 3) == 0.0
    assert toy_task.reward("aab", 3) == pytest.approx(2 / 3)
    assert toy_task.reward("a" * 9, 3) == 0.0
    labels = toy_task.draw_targets(2000, seed=1)
    answer, value = toy_task.prompt_independent_baseline(labels)
    assert set(answer) == {"a"} and 0.2 < value < 0.6  # a constant answer cannot solve the task
    assert np.percentile(labels, 99) > 3 * np.median(labels)  # lengths have a tail


def test_tokenizer_round_trips_whitespace(tiny_model_dir):
    from spillover.infra.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    text = "a*7= aaa\n  b"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_tiny_model_reloads_offline(tiny_model_dir):
    import torch

    from spillover.bench.reference_lm import load_causal_lm
    from spillover.infra.models import build_tiny_model

    model = load_causal_lm(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 2
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime
    build_tiny_model(tiny_model_dir)  # same shape and seed: kept as is
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime == before
    with torch.no_grad():
        assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, model.config.vocab_size)


def write(tmp_path, lines):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("lines, match", [
    (['{"prompt": "a*1=", "label": 1}', '{"prompt": "a*2=", "label": 2'], r"p.jsonl:2: not valid JSON"),
    (['{"prompt": "a*1="}'], r"p.jsonl:1: missing key 'label' \(set data.label_key"),
    (['{"text": "a*1=", "label": 1}'], r"missing key 'prompt'"),
    (['{"prompt": "  ", "label": 1}'], r"p.jsonl:1: empty prompt"),
    (['{"prompt": "aaaaaaaaaaaaaaaaaaaa", "label": 1}'], r"prompt #1 has 20 tokens.*over_long_prompts=truncate"),
])
def test_bad_prompt_files_name_line_and_fix(tmp_path, tiny_model_dir, lines, match):
    from spillover.infra.models import load_tokenizer

    with pytest.raises(PromptFileError, match=match):
        read_prompts(write(tmp_path, lines), load_tokenizer(tiny_model_dir), max_prompt_tokens=8)


@pytest.mark.parametrize("content, match", [
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03binary\n", r"p.jsonl:1: not UTF-8 text \(byte 0x8b at column 2\); "
     r"a prompt file \(data.prompts_path\) must be UTF-8 JSON Lines"),  # gzip's magic bytes
    ('{"prompt": "a*1=", "label": 1}\n{"prompt": "caf\xe9", "label": 2}\n'.encode("latin-1"),
     r"p.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"),
    (b'{"prompt": "a*1=", "label": 1}\n{"prompt": 42, "label": 2}\n',
     r"p.jsonl:2: 'prompt' must be a string \(the prompt text\); got number 42"),
    (b'{"prompt": ["a*1="], "label": 1}\n', r"p.jsonl:1: 'prompt' must be a string .*got array"),
    (b"\x00\x01\x02\n", r"p.jsonl:1: not valid JSON .*expected one JSON object with 'prompt' and 'label' per line"),
    (b"[1, 2]\n", r"p.jsonl:1: expected a JSON object with 'prompt' and 'label'; got a JSON array"),
], ids=["gzip", "latin-1", "number-prompt", "list-prompt", "control-bytes", "array-line"])
def test_binary_non_utf8_and_non_string_prompts_name_file_line_and_expectation(tmp_path, tiny_model_dir, content,
                                                                                match):
    from spillover.infra.models import load_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=match) as err:
        read_prompts(path, load_tokenizer(tiny_model_dir), max_prompt_tokens=8)
    assert str(path) in str(err.value)


def test_a_utf8_bom_is_not_an_error(tmp_path, tiny_model_dir):
    from spillover.infra.models import load_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a*1=", "label": 1}\n\n{"prompt": "a*2=", "label": 2}\n')
    assert read_prompts(path, load_tokenizer(tiny_model_dir), max_prompt_tokens=8).texts == ["a*1=", "a*2="]


def test_over_long_prompts_truncated_and_counted(tmp_path, tiny_model_dir):
    from spillover.infra.models import load_tokenizer

    p = write(tmp_path, [json.dumps({"prompt": "x" * 12 + "a*1=", "label": 1}), '{"prompt": "a*2=", "label": 2}'])
    prompts = read_prompts(p, load_tokenizer(tiny_model_dir), max_prompt_tokens=8, over_long="truncate")
    assert prompts.truncated_count == 1 and len(prompts.tokens[0]) == 8 and len(prompts.tokens[1]) == 4


def test_cursor_is_a_seeded_permutation_per_epoch_and_round_trips():
    cur = PromptCursor(num_prompts=10, seed=3)
    first = cur.dataset_indices(cur.take(10))
    second = cur.dataset_indices(cur.take(10))
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert list(first) != list(second)
    again = PromptCursor.from_state(json.loads(json.dumps(cur.state_dict())))
    assert again.position == 20 and list(again.dataset_indices(np.arange(10))) == list(first)


def test_batch_decode_fast_path_matches_the_tokenizers_own(tiny_model_dir):
    from spillover.infra.models import load_tokenizer
    from spillover.rollout.scoring.rule_reward import batch_decode

    tok = load_tokenizer(tiny_model_dir)
    texts = ["aaa", " a b ", "a*7=aaaa", "", "a\n a"]
    ids = [tok(t)["input_ids"] for t in texts] + [[tok.eos_token_id], tok("ab")["input_ids"] + [tok.eos_token_id]]
    assert not tok.clean_up_tokenization_spaces  # the fast path is taken
    assert batch_decode(ids, tok) == tok.batch_decode(ids, skip_special_tokens=True)
    assert batch_decode(ids[:5], tok) == texts
