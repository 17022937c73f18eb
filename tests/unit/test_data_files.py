"""How a data file is named (infra/data_files.py): Hub paths parse as huggingface_hub's own parser of HF URIs parses
them, and a pinned path names the commit; a local path and a file:// URL are read as they are; what cannot be read is
one error naming the setting. (Fetching from the Hub: tests/integration/test_hub_data.py.)"""
from __future__ import annotations

import json

import pytest

from spillover.infra.data_files import DataFileError, HubFile, data_file, parse_hub_path

HUB_PATHS = ["hf://datasets/openai/gsm8k/main/train-00000-of-00001.parquet",
             "hf://datasets/HuggingFaceH4/MATH-500@v1.0/test.jsonl",
             "hf://datasets/org/name@refs/pr/3/data/train.jsonl",
             "hf://datasets/org/name@refs/convert/parquet/default/train/0000.parquet",
             "hf://datasets/org/name@feature%2Fx/train.jsonl",
             "hf://models/org/name@0123456789abcdef0123456789abcdef01234567/eval.jsonl"]


@pytest.mark.parametrize("path", HUB_PATHS)
def test_hub_paths_parse_as_huggingface_hub_parses_them(path):
    from huggingface_hub.utils import parse_hf_uri

    ours, theirs = parse_hub_path(path, "data.prompts_path"), parse_hf_uri(path)
    assert (ours.repo_type, ours.repo_id, ours.revision, ours.filename) == (
        theirs.type, theirs.id, theirs.revision, theirs.path_in_repo)
    assert parse_hub_path(ours.uri(ours.revision), "x") == ours  # written back, it names the same file


def test_a_pinned_path_names_the_commit():
    hub = HubFile("dataset", "openai/gsm8k", None, "main/test-00000-of-00001.parquet")
    assert hub.uri("c" * 40) == f"hf://datasets/openai/gsm8k@{'c' * 40}/main/test-00000-of-00001.parquet"
    assert hub.uri(None) == "hf://datasets/openai/gsm8k/main/test-00000-of-00001.parquet"


@pytest.mark.parametrize("path", ["hf://datasets/org/name", "hf://datasets/org/name/", "hf://datasets/org",
                                  "hf://datasets/org/name/data/*.parquet", "hf://buckets/org/name/train.jsonl",
                                  "hf://org/name/train.jsonl"])
def test_a_path_that_names_no_single_hub_file_is_refused_naming_the_setting(path):
    with pytest.raises(DataFileError) as err:
        data_file(path, "data.eval_paths.test")
    assert str(err.value) == (f"data.eval_paths.test={path!r} is not a Hub file path: expected "
                              "hf://datasets/ORG/NAME[@REVISION]/FILE, one JSON Lines or Parquet file of a Hub data set")


def test_other_schemes_are_refused_naming_the_setting_and_the_ways_that_work():
    with pytest.raises(DataFileError, match=r"^data.prompts_path='https://host/train.jsonl': data files are read from "
                                            r"a local path, a file:// URL, the Hugging Face Hub .* or S3 "
                                            r"\(s3://BUCKET/KEY\); copy it to one of them$"):
        data_file("https://host/train.jsonl")


@pytest.mark.parametrize("path", ["s3://bucket", "s3://bucket/", "s3://bucket/data/", "s3:///train.jsonl"])
def test_an_s3_path_that_names_no_object_is_refused_before_any_request(path):
    with pytest.raises(DataFileError) as err:
        data_file(path, "data.eval_paths.test")
    assert str(err.value) == (f"data.eval_paths.test={path!r} is not an S3 object path: expected s3://BUCKET/KEY, "
                              "one JSON Lines or Parquet object")


def test_an_s3_path_with_credentials_is_refused_without_showing_them():
    with pytest.raises(DataFileError) as err:
        data_file("s3://AKIDEXAMPLE:s3cr3tvalue@bucket/train.jsonl")
    assert str(err.value) == ("data.prompts_path='s3://bucket/train.jsonl' carries credentials; put them in "
                              "storage.access_key_id / storage.secret_access_key or AWS_ACCESS_KEY_ID / "
                              "AWS_SECRET_ACCESS_KEY instead")


def test_local_paths_and_file_urls_are_read_and_named_as_given(tmp_path):
    from spillover.infra.models import build_char_tokenizer
    from spillover.rollout.prompt_data import PromptFileError, read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a*2=", "label": 2}) + "\n" + "{bad\n")
    for given in (str(path), f"file://{path}", path):
        assert data_file(given).local == path and str(data_file(given)) == str(given)
        assert data_file(given).pinned == str(given) and data_file(data_file(given)) == data_file(given)
        with pytest.raises(PromptFileError, match=rf"^{str(given)}:2: not valid JSON"):
            read_prompts(given, build_char_tokenizer(), 16)
    path.write_text(json.dumps({"prompt": "a*2=", "label": 2}) + "\n")
    assert read_prompts(f"file://{path}", build_char_tokenizer(), 16).labels == [2]
