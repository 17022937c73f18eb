"""infra/config/sglang_flags.json from SGLang's own parser (`ServerArgs.add_cli_args`), so that
engines.sglang_args accepts every flag SGLang 0.5.23 has, not only the ones the recorded contract lists.

    python tests/contract/server_args_extract.py > infra/config/sglang_flags.json

Each field: cli_flags (the option strings), type (the recorded contract's where it has the field, else the parser's
value type), default, choices, cli_kind for switches. `absent` (flags SGLang removed, with their replacements) and
the provenance come from the shipped file. tests/contract/test_contract_server_args.py checks the shipped file is
what this prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "infra" / "config" / "sglang_flags.json"
STORE_TRUE = "store_true (flag takes no value)"
BOOLEAN_OPTIONAL = "boolean_optional (--X true, --no-X false)"


def _json_value(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def field_of(action: argparse.Action, recorded: dict | None) -> dict:
    kind = type(action).__name__
    if kind in ("_StoreTrueAction", "DeprecatedStoreTrueAction"):
        field = {"type": "bool", "cli_kind": STORE_TRUE}
    elif kind == "BooleanOptionalAction":
        field = {"type": "bool", "cli_kind": BOOLEAN_OPTIONAL}
    else:
        value_type = getattr(action.type, "__name__", "str") if action.type is not None else "str"
        field = {"type": f"List[{value_type}]" if action.nargs in ("+", "*") else value_type}
    if recorded is not None:
        field["type"] = recorded["type"]
    field = {"cli_flags": list(action.option_strings), **field, "default": _json_value(action.default)}
    if action.choices:
        choices = action.choices if isinstance(action.choices, (list, tuple)) else sorted(action.choices)  # a set
        field["choices"] = [_json_value(c) for c in choices]
    return field


def extract() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_env import install_torchvision_stand_in

    install_torchvision_stand_in()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    shipped = json.loads(SHIPPED.read_text())
    recorded = shipped["fields"]
    fields = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS) or action.dest in fields:
            continue
        fields[action.dest] = field_of(action, recorded.get(action.dest))
    source = {**shipped["source"], "fields_from": "sglang.srt.server_args.ServerArgs.add_cli_args (SGLang's own "
              "parser, tests/contract/server_args_extract.py); types of the recorded contract's fields from it"}
    return {"source": source, "fields": dict(sorted(fields.items())), "absent": shipped["absent"]}


if __name__ == "__main__":
    print(json.dumps(extract(), indent=1))
