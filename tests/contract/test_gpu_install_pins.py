"""The GPU install line the README and the Makefile give installs: the torch they name is the one SGLang's own
metadata pins (sglang 0.5.23 requires torch==2.14.1; a line naming another torch made pip resolve a conflict)."""
from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pinned(package: str, requirement: str) -> str:
    """The exact version `requirement` (one of sglang's own) pins `package` to."""
    match = re.fullmatch(rf"{package}\s*==\s*([\w.]+)(\s*;.*)?", requirement.strip())
    return match.group(1) if match else ""


def test_readme_and_makefile_name_the_torch_sglang_pins():
    pins = {p for p in (pinned("torch", r) for r in requires("sglang") or []) if p}
    assert len(pins) == 1, requires("sglang")
    torch = pins.pop()
    readme, makefile = (REPO / "README.md").read_text(), (REPO / "Makefile").read_text()
    named = set(re.findall(r"TORCH_SPEC='torch==([\w.]+)'", readme)) | set(re.findall(r"torch==([\w.]+)' \.\.\.", makefile))
    assert named == {torch}, (named, torch)
