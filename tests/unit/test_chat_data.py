"""Prompt files as JSON Lines or Parquet, chat-message prompts rendered with the tokenizer's chat template,
data.additional_keys per group (file -> dock -> snapshot -> batch -> samples), and one clear error per bad input."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spillover.infra.models import build_char_tokenizer
from batch_views import select_groups
from spillover.rollout.batch import metadata_of_rows, to_samples
from spillover.rollout.prompt_data import PromptFileError, read_prompts
from spillover.rollout.dock.transfer_dock import TransferDock


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()  # the tiny model's tokenizer, with its chat template


def write_jsonl(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_prompts_tokenize_as_the_template_does(tmp_path, tok):
    messages = [{"role": "system", "content": "add."}, {"role": "user", "content": "1+2=?"}]
    path = write_jsonl(tmp_path, [{"prompt": messages, "label": 3}, {"prompt": "2+2=", "label": 4}])
    prompts = read_prompts(path, tok, 64)
    assert prompts.tokens[0] == template_ids(tok, messages)
    assert prompts.texts[0] == "system: add.\nuser: 1+2=?\nassistant: "
    assert prompts.texts[1] == "2+2=" and prompts.tokens[1] == tok("2+2=", add_special_tokens=False)["input_ids"]
    assert prompts.metadata is None  # no data.additional_keys


def test_system_prompt_and_text_prompts_as_chat(tmp_path, tok):
    own = [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]
    path = write_jsonl(tmp_path, [{"prompt": "1+1=", "label": 2}, {"prompt": own, "label": 0}])
    prompts = read_prompts(path, tok, 64, system_prompt="be brief.", apply_chat_template=True)
    assert prompts.texts[0] == "system: be brief.\nuser: 1+1=\nassistant: "
    assert prompts.tokens[0] == template_ids(tok, [{"role": "system", "content": "be brief."},
                                                   {"role": "user", "content": "1+1="}])
    assert prompts.texts[1] == "system: own\nuser: q\nassistant: "  # its own system message stays


def test_parquet_with_messages_and_additional_keys(tmp_path, tok):
    table = pa.table({
        "question": [[{"role": "user", "content": "1+1=?"}], [{"role": "user", "content": "2*3=?"}]],
        "answer": ["2", "6"], "source": ["gsm8k", "math"], "level": [1, 5], "unused": [0.5, 0.25]})
    path = tmp_path / "train.data"  # recognised by its PAR1 magic bytes, not its name
    pq.write_table(table, path)
    prompts = read_prompts(path, tok, 64, prompt_key="question", label_key="answer",
                           additional_keys=["source", "level"])
    assert prompts.labels == ["2", "6"]
    assert prompts.metadata == [{"source": "gsm8k", "level": 1}, {"source": "math", "level": 5}]
    assert prompts.tokens[1] == template_ids(tok, [{"role": "user", "content": "2*3=?"}])


def test_jsonl_additional_keys(tmp_path, tok):
    path = write_jsonl(tmp_path, [{"prompt": "1+1=", "label": 2, "id": "a", "tags": ["x"]}])
    assert read_prompts(path, tok, 64, additional_keys=("id", "tags")).metadata == [{"id": "a", "tags": ["x"]}]


MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("prompt, match", [
    (42, r"p.jsonl:2: 'prompt' must be a string \(the prompt text\); got number 42"),
    (["hi"], r"p.jsonl:2: 'prompt' must be a string .*got array \[\"hi\"\].*item #1 is a string"),
    ([{"content": "hi"}], r"p.jsonl:2: 'prompt' message #1 has no 'role'"),
    ([{"role": "user"}], r"p.jsonl:2: 'prompt' message #1 has no 'content'"),
    ([{}], r"p.jsonl:2: 'prompt' message #1 has no 'role' and no 'content'"),
    ([MESSAGE, {"role": "robot", "content": "x"}], r"p.jsonl:2: 'prompt' message #2 has unknown role \"robot\"; "
                                                     r"use one of system, user, assistant, tool"),
    ([{"role": "user", "content": 7}], r"p.jsonl:2: 'prompt' message #1 \(user\): 'content' must be a string"),
    ([], r"p.jsonl:2: 'prompt' is an empty list of chat messages"),
    ([MESSAGE, {"role": "assistant", "content": "x"}], r"p.jsonl:2: 'prompt': the last message is the assistant's"),
    ({"role": "user"}, r"p.jsonl:2: 'prompt' must be a string .*got object"),
])
def test_bad_prompts_name_file_and_line(tmp_path, tok, prompt, match):
    path = write_jsonl(tmp_path, [{"prompt": "ok", "label": 1}, {"prompt": prompt, "label": 1}])
    with pytest.raises(PromptFileError, match=match):
        read_prompts(path, tok, 64)


def test_other_bad_inputs(tmp_path, tok):
    path = write_jsonl(tmp_path, [{"prompt": "ok", "label": 1, "id": 1}, {"prompt": "ok", "label": 1}])
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: missing key 'id' \(set data.additional_keys"):
        read_prompts(path, tok, 64, additional_keys=["id"])
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: data.system_prompt is set but this prompt is plain text"):
        read_prompts(path, tok, 64, system_prompt="s")
    plain = build_char_tokenizer()
    plain.chat_template = None
    chat = write_jsonl(tmp_path, [{"prompt": [MESSAGE], "label": 1}], "c.jsonl")
    with pytest.raises(PromptFileError, match=r"c.jsonl:1: the tokenizer has no chat template"):
        read_prompts(chat, plain, 64)
    long = write_jsonl(tmp_path, [{"prompt": "ok", "label": 1}, {"prompt": [{"role": "user", "content": "x" * 80}],
                                                                   "label": 1}], "l.jsonl")
    with pytest.raises(PromptFileError, match=r"l.jsonl:2: prompt #2 has 98 tokens"):
        read_prompts(long, tok, 64)


def test_bad_parquet_files(tmp_path, tok):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + b"\x00" * 20)
    with pytest.raises(PromptFileError, match=r"broken.parquet: not a readable Parquet file"):
        read_prompts(broken, tok, 64)
    import datetime

    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "label": [1, 2],
                             "when": [datetime.date(2024, 1, 1)] * 2}), odd)
    with pytest.raises(PromptFileError, match=r"odd.parquet row 1: the label 'label' and data.additional_keys "
                                              r"values must be JSON values"):
        read_prompts(odd, tok, 64, additional_keys=["when"])
    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.table({"text": ["a"], "label": [1]}), missing)
    with pytest.raises(PromptFileError, match=r"missing.parquet: no column 'prompt' \(set data.prompt_key.*"
                                              r"columns: \['text', 'label'\]"):
        read_prompts(missing, tok, 64)
    bad_prompt = tmp_path / "num.parquet"
    pq.write_table(pa.table({"prompt": [1.5], "label": [1]}), bad_prompt)
    with pytest.raises(PromptFileError, match=r"num.parquet row 1: 'prompt' must be a string .*got number 1.5"):
        read_prompts(bad_prompt, tok, 64)


def test_metadata_rides_the_dock_snapshot_and_batch():
    dock = TransferDock(gbs=2, n=2, max_split=1, max_tokens=4, max_model_len=16, eos_token_ids=[1])
    meta = [{"id": "a", "level": 1}, {"id": "b", "level": [2, 3]}]
    dock.load_groups([10, 11], [[3, 4], [5]], ["x", "y"], meta)
    rows = dock.take_rows()
    dock.put_generation(rows, [[7, 1]] * len(rows), [[-0.5, -0.5]] * len(rows), 0, [True] * len(rows))
    dock.select_batch()
    arrays, snap = dock.snapshot()
    snap = json.loads(json.dumps(snap))  # the checkpoint stores it as JSON
    restored = TransferDock.restore(arrays, snap, "a snapshot in memory")
    for d in (dock, restored):
        batch = d.rollout_batch()
        assert batch.metadata == tuple(meta) and batch.labels == ("x", "y")
        assert metadata_of_rows(batch) == [meta[0], meta[0], meta[1], meta[1]]
        assert [g[0].metadata["data"] for g in to_samples(batch)] == meta
        assert select_groups(batch, [1]).metadata == (meta[1],)
    dock.clear()
    assert dock.metadata == [None] * dock.capacity_groups


def test_debug_rollout_data_keeps_metadata(tmp_path):
    from spillover.rollout.batch import RolloutBatch
    from spillover.rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data

    dock = TransferDock(gbs=1, n=2, max_split=1, max_tokens=4, max_model_len=16, eos_token_ids=[1])
    dock.load_groups([0], [[3, 4]], [5], [{"id": "q0"}])
    rows = dock.take_rows()
    dock.put_generation(rows, [[7, 1], [8, 1]], [[-0.1, -0.2], [-0.3, -0.4]], 0, [True, True])
    dock.select_batch()
    template = str(tmp_path / "rollout_{rollout_id}.parquet")
    save_debug_rollout_data(template, 0, to_samples(dock.rollout_batch()))
    replayed = RolloutBatch.from_samples(load_debug_rollout_data(template, 0))
    assert replayed.metadata == ({"id": "q0"},) and replayed.labels == (5,)
    assert np.array_equal(replayed.response_tokens, dock.rollout_batch().response_tokens)


def test_a_conversation_the_template_refuses_names_its_line(tmp_path):
    """A template's own error (jinja raise_exception, as Gemma's "System role not supported") names the file line."""
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
    ok = [{"role": "user", "content": "1+1=?"}]
    refused = [{"role": "system", "content": "add."}, {"role": "user", "content": "1+2=?"}]
    path = write_jsonl(tmp_path, [{"prompt": ok, "label": 2}, {"prompt": refused, "label": 3}])
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: the model's chat template refused this conversation "
                                              r"\(TemplateError: System role not supported\)"):
        read_prompts(path, tok, 64)
