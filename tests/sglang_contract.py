"""SGLang's recorded HTTP routes and server fields (../shared/sglang-contract, or the copy in tests/data), and
checks of a client's payloads against them: every key a field of the route's request type, every required one
present."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACES = (ROOT.parent / "shared" / "sglang-contract", ROOT / "tests" / "data" / "sglang_contract")


@cache
def record(name: str) -> dict:
    for folder in PLACES:
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    raise FileNotFoundError(f"{name} not found in {[str(p) for p in PLACES]}")


def route(path: str) -> dict:
    found = [r for r in record("http_routes.json")["routes"] if r["path"] == path]
    assert found, f"{path} is not one of SGLang's recorded routes"
    return found[0]


def check_payload(path: str, payload: dict) -> None:
    """Assert that payload is a valid request body of SGLang's route `path`."""
    fields = {f["name"]: f for f in route(path)["request_fields"]}
    unknown = sorted(set(payload) - set(fields))
    assert not unknown, f"{path}: {unknown} are not fields of {route(path)['request']}"
    missing = sorted(n for n, f in fields.items() if f.get("required") and n not in payload)
    assert not missing, f"{path}: required fields {missing} missing"


def field_default(path: str, name: str):
    return {f["name"]: f for f in route(path)["request_fields"]}[name].get("default")
