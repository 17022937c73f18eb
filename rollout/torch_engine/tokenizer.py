"""The torch engine's tokenizer: the `tokenizers` backend read straight from tokenizer.json, without importing
transformers (~0.6 CPU-s less per engine start). transformers' fast tokenizer encodes and decodes with that same
backend, but tokenizer_config.json can change what it does: clean_up_tokenization_spaces (a string edit after the
decode), add_prefix_space (a different pre-tokenizer), or special tokens that tokenizer.json does not mark special
(skip_special_tokens would keep them). A folder with any of these, or without tokenizer.json, gets transformers'
tokenizer as before."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class BackendTokenizer:
    """encode/decode with PreTrainedTokenizerFast's results, for a folder `backend_is_enough` accepts."""

    def __init__(self, backend: Tokenizer):
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _content(token) -> str | None:
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def backend_is_enough(tokenizer_json: dict, config: dict) -> bool:
    """Whether tokenizer.json alone encodes and decodes as transformers would with this tokenizer_config.json."""
    if config.get("clean_up_tokenization_spaces") or config.get("add_prefix_space") is not None:
        return False
    special = {t["content"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    wanted = [config.get(key) for key in SPECIAL_TOKEN_KEYS]
    wanted += list(config.get("additional_special_tokens") or config.get("extra_special_tokens") or [])
    wanted += [t for t in (config.get("added_tokens_decoder") or {}).values()
               if isinstance(t, dict) and t.get("special")]
    return all(_content(t) is None or _content(t) in special for t in wanted)


def load_engine_tokenizer(model_path: str | Path):
    """BackendTokenizer where `backend_is_enough`; else transformers' tokenizer (spillover.infra.models.load_tokenizer)."""
    folder = Path(model_path)
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if tokenizer_file.is_file():
        text = tokenizer_file.read_text()  # read once: a real model's tokenizer.json is ~10 MB
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if backend_is_enough(json.loads(text), config):
            return BackendTokenizer(Tokenizer.from_str(text))
    from ...infra.models import load_tokenizer

    return load_tokenizer(folder)
