"""A small byte-level BPE tokenizer with a Qwen-style chat template, trained here with `tokenizers` (offline,
deterministic): the tiny model's `model.tiny.tokenizer=bpe` (configs/tiny-math.yaml), so the CPU path runs
what a real model's tokenizer does -- multi-character tokens, special tokens written by the chat template,
stop strings that span tokens, any Unicode text.
"""
from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("What is", "Compute", "Calculate", "The answer is", "so the result is", "Put the final answer in",
         "Please reason step by step", "system", "user", "assistant", "plus", "minus", "times")


def training_corpus(count: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic questions and boxed answers in chat markup: the text the tiny math task produces."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        system = f"{IM_START}system\n{rng.choice(WORDS[5:7])} \\boxed{{}}.{IM_END}\n" if rng.random() < 0.5 else ""
        lines.append(f"{system}{IM_START}user\n{rng.choice(WORDS[:3])} {a} {op} {b}?{IM_END}\n{IM_START}assistant\n"
                     f"{rng.choice(WORDS[3:5])} \\boxed{{{value}}}.{IM_END}")
    return lines + list(WORDS)


def build_bpe_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on training_corpus(seed) -> an HF fast tokenizer (pad <|endoftext|>, eos <|im_end|>,
    left padding) with the chat template above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, unk_token=None,
                                        padding_side="left", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
