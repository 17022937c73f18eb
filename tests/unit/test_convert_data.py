"""GSM8K/MATH converters (spillover.rollout.builtin.convert_data) and the GPU recipes (configs/gpu/*.yaml) load and agree with them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spillover.infra.config.run_config import load_config
from spillover.infra.models import build_char_tokenizer
from spillover.rollout.builtin.convert_data import convert, main
from spillover.rollout.prompt_formats import ConvertError, last_boxed
from spillover.rollout.prompt_data import read_prompts

GPU_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "gpu").glob("*.yaml"))  # from any cwd


def test_gsm8k_to_parquet_reads_as_chat_prompts(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": "what is 2+2?", "answer": "2+2=4\n#### 4"}) + "\n"
                   + json.dumps({"question": "and 600+600?", "answer": "so\n#### 1,200"}) + "\n")
    assert convert("gsm8k", src, tmp_path / "out.parquet") == 2
    prompts = read_prompts(tmp_path / "out.parquet", build_char_tokenizer(), 200, additional_keys=["id"],
                           system_prompt="be brief.", apply_chat_template=True)
    assert prompts.labels == ["4", "1200"] and prompts.metadata == [{"id": "gsm8k-1"}, {"id": "gsm8k-2"}]
    assert prompts.texts[0] == "system: be brief.\nuser: what is 2+2?\nassistant: "


def test_data_format_reads_the_original_files_as_the_converter_writes_them(tmp_path):
    """data.format=gsm8k | math: the Hub's own rows (JSON Lines or Parquet) train without a conversion step, read as
    `convert_data` would have written them; a bad row names its line and the setting."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spillover.infra.config.run_config import build_config
    from spillover.rollout.prompt_data import PromptFileError, read_prompt_file

    tok = build_char_tokenizer()
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "what is 2+2?", "answer": "2+2=4\n#### 4"}) + "\n"
                     + json.dumps({"question": "and 600+600?", "answer": "so\n#### 1,200"}) + "\n")
    data = build_config({}, ["data.format=gsm8k", "data.additional_keys=[id]"]).data
    direct = read_prompt_file(gsm8k, tok, data, 200)
    assert convert("gsm8k", gsm8k, tmp_path / "converted.jsonl") == 2
    converted = read_prompts(tmp_path / "converted.jsonl", tok, 200, additional_keys=["id"])
    assert (direct.texts, direct.labels, direct.metadata) == (converted.texts, converted.labels, converted.metadata)
    assert direct.labels == ["4", "1200"]
    math = tmp_path / "math.parquet"  # no 'answer' column: the label is the solution's last box
    pq.write_table(pa.table({"problem": ["1/2 + 1/2?"], "solution": [r"it is \boxed{1}"], "level": ["Level 1"],
                             "type": ["Algebra"]}), math)
    rows = read_prompt_file(math, tok, build_config({}, ["data.format=math",
                                                         "data.additional_keys=[id,level,type]"]).data, 200)
    assert rows.labels == ["1"] and rows.metadata == [{"id": "math-1", "level": "Level 1", "type": "Algebra"}]
    gsm8k.write_text(json.dumps({"question": "no final line", "answer": "4"}) + "\n")
    with pytest.raises(PromptFileError, match=r"gsm8k.jsonl:1: 'answer' has no '#### <number>'.*data.format=gsm8k"):
        read_prompt_file(gsm8k, tok, data, 200)


def test_math_labels_are_the_last_balanced_box(tmp_path):
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{a}{b^{2}}} done") == r"\frac{a}{b^{2}}"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unclosed") is None
    src = tmp_path / "math.jsonl"
    src.write_text(json.dumps({"problem": "p", "solution": r"x \boxed{\{1,2\}}", "level": "Level 2",
                               "type": "Algebra"}) + "\n")
    convert("math", src, tmp_path / "out.jsonl")
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row == {"prompt": "p", "label": r"\{1,2\}", "id": "math-1", "level": "Level 2", "type": "Algebra"}


@pytest.mark.parametrize("kind, line, match", [
    ("gsm8k", {"question": "q", "answer": "4"}, r"in.jsonl:2: 'answer' has no '#### <number>'"),
    ("gsm8k", {"question": 3, "answer": "#### 4"}, r"in.jsonl:2: 'question' must be non-empty text"),
    ("math", {"problem": "p", "solution": "none"}, r"in.jsonl:2: 'solution' holds no \\boxed"),
])
def test_bad_rows_name_file_and_line(tmp_path, capsys, kind, line, match):
    good = {"gsm8k": {"question": "q", "answer": "#### 1"}, "math": {"problem": "p", "solution": r"\boxed{1}"}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(good[kind]) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ConvertError, match=match):
        convert(kind, src, tmp_path / "out.jsonl")
    assert main([kind, str(src), str(tmp_path / "out.jsonl")]) == 2 and "in.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.stem for p in GPU_CONFIGS])
def test_gpu_recipes_load(path):
    cfg = load_config(path)
    assert cfg.grpo.reward_function_path == "spillover.rollout.builtin.math_reward.reward" and cfg.engines.backend == "sglang"
    assert cfg.data.apply_chat_template and cfg.learner.device == "cuda" and cfg.rollout.partial


def test_the_four_gpu_recipes_are_found():  # outside the parametrized test: an empty glob would run no case there
    assert [p.stem for p in GPU_CONFIGS] == ["qwen2.5-0.5b-gsm8k", "qwen2.5-0.5b-math", "qwen2.5-1.5b-gsm8k",
                                             "qwen2.5-1.5b-math"]
