"""The configuration reference (docs/config-fields.md), rendered from the pydantic models so it cannot drift from them.

`python -m spillover.infra.config.reference > docs/config-fields.md` rewrites it; tests/unit/test_config_reference.py checks that the
committed page is current.
"""
from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

HEADER = """# Config fields: every field, its type, default and meaning (generated)

Every field of the run configuration (`infra/config/run_config.py`, `RunConfig`), generated from the pydantic models by
`python -m spillover.infra.config.reference > docs/config-fields.md`. Set a field in the YAML file (`configs/tiny.yaml`) or on the
command line with its dotted name (`rollout.max_split=4`). Unknown keys are refused. The defaults below are the models'
own: a config file overrides them (`configs/tiny.yaml`, the demo's, sets a few: its comments say which and why). How to
write prompt files and reward functions, and what the sections are for (the guide): [configuration.md](configuration.md).
"""


def _type_name(annotation: Any) -> str:
    """A short readable name of a field's type (`int`, `str | None`, `"sync" | "async"`, `list[RewardModelConfig]`)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    try:
        return "`" + json.dumps(value) + "`"
    except TypeError:
        return f"`{value}`"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _rows(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel]]]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        section = _section_type(field.annotation)
        if section is not None:
            sections.append((prefix + name, section))
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {_type_name(field.annotation)} | {_default(field)} | {description} |")
    return rows


def render_reference(model: type[BaseModel] | None = None) -> str:
    """Markdown: one table per section (top-level fields first), every field's name, type, default, description."""
    if model is None:
        from .run_config import RunConfig

        model = RunConfig
    out = [HEADER.rstrip("\n")]
    pending: list[tuple[str, type[BaseModel]]] = [("", model)]
    while pending:
        prefix, section = pending.pop(0)
        nested: list[tuple[str, type[BaseModel]]] = []
        rows = _rows(section, prefix + "." if prefix else "", nested)
        pending = nested + pending  # a subsection right after its parent
        if not rows:
            continue
        out.append(f"\n## `{prefix}`\n" if prefix else "\n## Top level\n")
        doc = (section.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        if prefix and doc and not doc.startswith("Usage docs"):
            out.append(doc + "\n")
        out.append("| field | type | default | description |\n|---|---|---|---|")
        out.extend(rows)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
