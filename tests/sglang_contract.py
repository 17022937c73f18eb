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


def check_sampling_params(params: dict) -> None:
    """Assert that every key of a /generate sampling_params object is one of SGLang's (the JSON gate answers 400)."""
    known = {f["name"] for f in record("sampling_params.json")["fields"]}
    unknown = sorted(set(params) - known)
    assert not unknown, f"sampling_params {unknown} are not SGLang's (HTTP 400); keys are {sorted(known)}"


def check_server_flags(argv: list[str]) -> None:
    """Assert that every --flag of a `sglang.launch_server` argv is one of ServerArgs' flags (removed ones refused)."""
    args = record("server_args.json")
    flags = {flag for f in args["fields"] for flag in f.get("cli_flags") or ()}
    flags |= {f["flag"].split()[0] for f in args.get("deprecated_flags_still_accepted") or ()}
    removed = {f["old_flag"]: f["replacements"] for f in args["absent_in_this_version"]}
    for token in argv:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        assert flag not in removed, f"{flag} was removed in SGLang 0.5.23; use one of {removed[flag]}"
        assert flag in flags, f"{flag} is not a flag of SGLang 0.5.23's ServerArgs"
