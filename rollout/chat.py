"""Chat prompts: check a prompt (a string or a list of {"role", "content"} messages) and render it with the
tokenizer's chat template.

A rendered prompt is `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`,
then tokenized without special tokens (the template already wrote them): the ids equal the template's own
tokenize=True output. `data.system_prompt` becomes the first message of a conversation that has none.
"""
from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ChatPromptError(ValueError):
    """A prompt that is neither text nor a list of chat messages; the message says what is wrong."""


def check_prompt(prompt: Any, key: str) -> str | list[dict[str, str]]:
    """A prompt value from a file -> the text, or the messages (copied, only role and content).
    Raises ChatPromptError saying what is wrong (the caller adds file and line)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ChatPromptError(f"empty prompt under {key!r}; remove the line")
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise ChatPromptError(f"{key!r} must be a string (the prompt text); got {_kind(prompt)} {_show(prompt)} "
                              '(or a list of chat messages [{"role": "user", "content": "..."}])')
    if not prompt:
        raise ChatPromptError(f"{key!r} is an empty list of chat messages; give at least one "
                              '{"role": "user", "content": "..."}')
    messages = []
    for i, message in enumerate(prompt):
        where = f"{key!r} message #{i + 1}"
        if not isinstance(message, dict):
            raise ChatPromptError(f"{key!r} must be a string (the prompt text); got array {_show(prompt)} (a list "
                                  f"is read as chat messages, and item #{i + 1} is a {_kind(message)}, not an object "
                                  '{"role": ..., "content": ...})')
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            raise ChatPromptError(f"{where} has no {' and no '.join(repr(k) for k in missing)}; every message needs "
                                  f"'role' (one of {', '.join(ROLES)}) and 'content' (text); keys present: "
                                  f"{sorted(message)}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ChatPromptError(f"{where} has unknown role {_show(role)}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatPromptError(f"{where} ({role}): 'content' must be a string; got {_kind(content)} "
                                  f"{_show(content)}")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] == "assistant":
        raise ChatPromptError(f"{key!r}: the last message is the assistant's; a prompt ends with the turn the "
                              "model answers (user or tool)")
    return messages


def to_messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """A checked prompt -> messages: a string becomes one user message; the system prompt goes first unless
    the conversation has its own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_messages(tokenizer, conversations: list[list[dict[str, str]]]) -> list[str]:
    """Conversations -> prompt texts through the tokenizer's chat template (with the generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatPromptError("the tokenizer has no chat template, so chat-message prompts (or "
                              "data.apply_chat_template / data.system_prompt) cannot be rendered: use a model "
                              "folder whose tokenizer_config.json or chat_template.jinja holds one, or plain "
                              "string prompts")
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in conversations]


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "number", float: "number", list: "array", tuple: "array", dict: "object",
             type(None): "null", str: "string"}
    return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return repr(value)[:40]
