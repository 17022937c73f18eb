"""HF model and tokenizer loading, and the tiny Qwen2 + char-level tokenizer used on CPU.

The tokenizer is loaded with `PreTrainedTokenizerFast` on purpose: `AutoTokenizer` on a qwen2 folder
returns Qwen2Tokenizer, which silently drops spaces and newlines from a char-level vocab.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
# The model classes are imported where a model is built: the driver and the engines only tokenize (~0.5 CPU-s
# less per process start).
from transformers import PreTrainedTokenizerFast

from .config.run_config import TinyModelConfig
from .hub_models import is_hub_id, resolve_hub_model

PAD, EOS = "<pad>", "<eos>"
TINY_ALPHABET = " \n0123456789abcdefghijklmnopqrstuvwxyz:=+-*.,?!"
TINY_MARKER = "spillover_tiny.json"
# A chat template the char vocabulary can spell (lower case, no special tokens): "role: content" lines, then
# "assistant: " as the generation prompt. Enough to run chat-message prompts offline through the real path.
TINY_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def build_char_tokenizer(alphabet: str = TINY_ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `alphabet`, plus <pad> (0) and <eos> (1)."""
    vocab = {PAD: 0, EOS: 1}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=PAD, padding_side="left",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off inside the block (and back as they were after it)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None, seed: int = 0,
                     max_position: int = 512) -> Path:
    """Write a randomly initialised tiny Qwen2 causal LM and its tokenizer (char, or BPE: model.tiny.tokenizer) to
    `out_dir` (HF format).

    Idempotent: an existing tiny model with the same shape and seed is kept.
    """
    cfg = cfg or TinyModelConfig()
    out = Path(out_dir)
    marker = {"tiny": cfg.model_dump(), "seed": seed, "max_position": max_position, "chat_template": 1}
    if (out / TINY_MARKER).is_file() and json.loads((out / TINY_MARKER).read_text()) == marker:
        return out
    if cfg.tokenizer == "bpe":
        from .tiny_bpe import build_bpe_tokenizer

        tokenizer = build_bpe_tokenizer(seed=seed)
    else:
        tokenizer = build_char_tokenizer()
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max_position,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    out.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():  # a one-shard bar on every start is noise on the console
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / TINY_MARKER).write_text(json.dumps(marker))
    return out


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer offline; fast tokenizers load as PreTrainedTokenizerFast to keep whitespace."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model.path {str(p)!r} is not a folder holding an HF checkpoint")
    if (p / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(p, local_files_only=True)


def end_token_ids(path: str | Path, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a response, as SGLang's scheduler counts them: the tokenizer's EOS and the
    eos_token_id (an id or a list) of the folder's config.json and generation_config.json. Qwen2.5-Instruct ends
    on 151645 (<|im_end|>) and also on 151643 (<|endoftext|>): a row whose answer ends on either is complete, also
    when an abort returned that token as its last."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for name in ("config.json", "generation_config.json"):
        file = Path(path) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids |= {int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])}
    return tuple(sorted(ids))


def resolve_model_path(model_cfg, run_dir: str | Path, max_position: int = 512, storage=None) -> Path:
    """The HF folder a run uses: `model.path`, its copy in this node's model.cache_dir when it is an s3:// URL
    (infra/storage/model_staging.py; `storage` gives the endpoint and credentials), its snapshot in huggingface_hub's
    cache when it is a Hub id (infra/hub_models.py), or the tiny model built into `<run_dir>/tiny_model`."""
    from .storage.model_staging import is_remote_model, stage_model

    if is_remote_model(model_cfg.path):
        from .config.run_config import StorageConfig

        return Path(stage_model(model_cfg.path, storage or StorageConfig(), model_cfg.cache_dir)[0])
    if is_hub_id(model_cfg.path):
        return resolve_hub_model(model_cfg.path, model_cfg.revision)[0]
    if model_cfg.path:
        return Path(model_cfg.path)
    return build_tiny_model(Path(run_dir) / "tiny_model", model_cfg.tiny, model_cfg.seed, max_position)
