"""From user input to config data and back to the user: `key=value` overrides, and pydantic validation
errors as one ConfigError message that names the field (used by spillover.infra.config.run_config)."""
from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the fix."""


def _parse_value(text: str) -> Any:
    """YAML for numbers, booleans, lists and mappings. Text that YAML cannot read (a password with '@' or '%') or
    would cut at a ' #' comment (a prompt) stays the text as given; a YAML error could also echo a secret."""
    if text == "":
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if "#" in text and (value is None or isinstance(value, str)) and text.lstrip()[:1] not in ("'", '"'):
        return text
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set dotted keys from `key=value` strings (values parsed as YAML: 3, 1e-3, true, [a, b])."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. rollout.max_split=4)")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
        node[parts[-1]] = _parse_value(value)
    return data


def format_validation_error(err: ValidationError) -> str:
    """Every error of `err` on one line: "invalid config: rollout.max_split: ...; ..."."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(msg if msg.startswith(field.split(".")[0] + ".") or not e["loc"] else f"{field}: {msg}")
    return "invalid config: " + "; ".join(lines)
