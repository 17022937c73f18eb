"""The dead-code check (vulture): no function, method, class or property in flows/, tasks/, rollout/ or infra/
that nothing uses, and no unused import or unreachable code there.

Uses are counted over the whole repository: tests and bench drive public API that a run itself does not (e.g.
RolloutManager.onload), and that is not dead. What only a framework calls is recognised by its decorator (pydantic
validators, FastAPI routes, Prefect flows and tasks) or named in tests/dead_code_whitelist.py (Ray actor methods
called by name, torch hooks). Unused variables and attributes are not checked: pydantic fields and SGLang's
wire-format fields are read by the frameworks."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from vulture import Vulture

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("flows", "tasks", "rollout", "infra")
USERS = (*LAYERS, "tests", "bench")
FRAMEWORK_DECORATORS = ["@model_validator", "@field_validator", "@app.*", "@flow", "@task"]
CHECKED = {"function", "method", "class", "property", "import", "unreachable_code"}


def unused_definitions(root: Path, layers: Sequence[str] = LAYERS, users: Sequence[str] = USERS) -> list[str]:
    """Vulture's reports ("path:line: unused function 'name' ...") for definitions under `layers` of `root`
    that no file under `users` uses."""
    scan = Vulture(ignore_decorators=FRAMEWORK_DECORATORS)
    scan.scavenge([str(root / p) for p in users if (root / p).exists()])
    found = []
    for item in scan.get_unused_code(min_confidence=0):
        rel = Path(item.filename).resolve().relative_to(root.resolve())
        if rel.parts[0] in layers and item.typ in CHECKED:
            found.append(f"{rel}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)")
    return found


def test_no_dead_code():
    found = unused_definitions(REPO)
    assert not found, ("unused code (delete it; if only a framework calls it by name, add the name to "
                       "tests/dead_code_whitelist.py):\n" + "\n".join(found))


def test_the_check_finds_a_new_unused_function(tmp_path):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rollout" / "part.py").write_text(
        "import os\n"
        "from pydantic import BaseModel, field_validator\n\n\n"
        "class Settings(BaseModel):\n"
        "    size: int = 1\n\n"
        "    @field_validator('size')\n"
        "    @classmethod\n"
        "    def _positive(cls, value):\n"
        "        return value\n\n\n"
        "def called_by_a_test():\n    return Settings()\n\n\n"
        "def never_called():\n    return 1\n")
    (tmp_path / "tests" / "test_part.py").write_text("from rollout.part import called_by_a_test\n\n"
                                                       "def test_part():\n    called_by_a_test()\n")
    found = unused_definitions(tmp_path)
    assert [line.split(": ", 1)[1].split(" (")[0] for line in found] == ["unused import 'os'",
                                                                         "unused function 'never_called'"]
