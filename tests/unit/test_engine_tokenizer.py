"""The torch engine's tokenizer reads tokenizer.json with `tokenizers` alone and encodes/decodes exactly as
transformers' tokenizer of the same folder; folders where tokenizer_config.json changes transformers' results get
transformers' tokenizer. An engine process then starts, generates and loads weights without importing transformers
or torch._dynamo (together ~1.8 CPU-s of every engine start)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spillover.infra.models import build_char_tokenizer, load_tokenizer
from spillover.rollout.torch_engine.tokenizer import BackendTokenizer, backend_is_enough, load_engine_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["12+3=15", "what is 7*8? 56.", " two  spaces\nand a newline ", ""]


def bpe_folder(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer with two special tokens, saved the way HF checkpoints ship (transformers'
    save_pretrained: tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>", "<|pad|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>", pad_token="<|pad|>")
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_backend_encodes_and_decodes_like_transformers(kind, tmp_path):
    folder = bpe_folder(tmp_path) if kind == "bpe" else tmp_path
    if kind == "char":
        build_char_tokenizer().save_pretrained(folder)
    ours, theirs = load_engine_tokenizer(folder), load_tokenizer(folder)
    assert isinstance(ours, BackendTokenizer)
    special = [theirs.eos_token_id, theirs.pad_token_id]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False)
        with_special = [special[0], *ids, *special]
        for skip in (False, True):
            assert ours.decode(with_special, skip_special_tokens=skip) == theirs.decode(with_special,
                                                                                      skip_special_tokens=skip)


def test_configs_that_change_transformers_results_get_transformers(tmp_path):
    folder = bpe_folder(tmp_path)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert backend_is_enough(tokenizer_json, config)
    for changed in ({"clean_up_tokenization_spaces": True}, {"add_prefix_space": True},
                    {"additional_special_tokens": ["the"]}, {"bos_token": {"content": "<|start|>"}}):
        assert not backend_is_enough(tokenizer_json, {**config, **changed}), changed
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_engine_tokenizer(folder), BackendTokenizer)


ENGINE_PROCESS = """
import sys, httpx
from spillover.rollout.torch_engine.server import TorchEngineServer
server = TorchEngineServer(sys.argv[1], max_running_requests=4, seed=0)
server.start()
try:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    text = httpx.post(server.url + "/generate", json=body, timeout=60).json()["text"]
    server.load_weights(server.read_weights_from_disk(sys.argv[1]), weight_version=1)
finally:
    server.stop()
print(len(text), "transformers" in sys.modules, "torch._dynamo" in sys.modules)
"""


def test_an_engine_starts_generates_and_loads_weights_without_transformers_or_dynamo(tiny_model_dir):
    out = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(tiny_model_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["4", "False", "False"], out.stdout
