"""The dead-code check (vulture): no function, method, class or property in flows/, tasks/, rollout/ or infra/
that nothing uses, and no unused import or unreachable code there.

Two passes. The first counts uses over the whole repository. The second counts only the runtime (flows/, tasks/,
rollout/, infra/): a definition that only tests or bench use belongs in tests/ or bench/, not in a class or module a
run loads; PUBLIC_API names what a user imports or a config path names although no runtime module calls it. In both,
what only a framework calls is recognised by its decorator (pydantic validators, FastAPI routes, Prefect flows and
tasks) or named in tests/dead_code_whitelist.py (Ray actor methods called by name, torch hooks), and a name listed in
a module's `__all__` is not a use (an export calls nothing). Unused variables and attributes are not checked:
pydantic fields and SGLang's wire-format fields are read by the frameworks."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Collection, Sequence

from vulture import Vulture

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("flows", "tasks", "rollout", "infra")
USERS = (*LAYERS, "tests", "bench")
FRAMEWORK_NAMES = "tests/dead_code_whitelist.py"
RUNTIME_USERS = (*LAYERS, FRAMEWORK_NAMES)
# (file, name): what a user imports or a config path names, although no runtime module calls it
PUBLIC_API = {
    ("rollout/builtin/sft.py", "generate_sft_rollout"),  # rollout.rollout_function_path for SFT
    ("rollout/builtin/calculator.py", "CalculatorEnv"),  # rollout.env_path (configs/tiny-tools.yaml)
    ("infra/tracking/wandb_shared.py", "join_shared_run"),  # a user's own Ray actors (docs/deploy-and-watch.md)
}
FRAMEWORK_DECORATORS = ["@model_validator", "@field_validator", "@app.*", "@flow", "@task"]
CHECKED = {"function", "method", "class", "property", "import", "unreachable_code"}


class ExportsAreNoUse(Vulture):
    """Vulture, except that a name listed in `__all__` counts as unused until some code uses it."""

    def visit_Assign(self, node):
        if not any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
            super().visit_Assign(node)


def unused_definitions(root: Path, layers: Sequence[str] = LAYERS, users: Sequence[str] = USERS,
                       public_api: Collection[tuple[str, str]] = ()) -> list[str]:
    """Vulture's reports ("path:line: unused function 'name' ...") for definitions under `layers` of `root`
    that no file under `users` uses, but for the (file, name) pairs in `public_api`."""
    scan = ExportsAreNoUse(ignore_decorators=FRAMEWORK_DECORATORS)
    scan.scavenge([str(root / p) for p in users if (root / p).exists()])
    found = []
    for item in scan.get_unused_code(min_confidence=0):
        rel = Path(item.filename).resolve().relative_to(root.resolve())
        if rel.parts[0] in layers and item.typ in CHECKED and (rel.as_posix(), item.name) not in public_api:
            found.append(f"{rel}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)")
    return found


def test_no_dead_code():
    found = unused_definitions(REPO)
    assert not found, ("unused code (delete it; if only a framework calls it by name, add the name to "
                       "tests/dead_code_whitelist.py):\n" + "\n".join(found))


def test_no_definition_only_tests_or_bench_use():
    found = unused_definitions(REPO, users=RUNTIME_USERS, public_api=PUBLIC_API)
    assert not found, ("definitions that no runtime module uses (move a helper only tests use into tests/, one bench "
                       "uses into bench/, delete a dead one; add what a user imports or a config path names to "
                       "PUBLIC_API):\n" + "\n".join(found))


def test_public_api_names_what_is_defined():
    for path, name in sorted(PUBLIC_API):
        tree = ast.parse((REPO / path).read_text())
        assert any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name
                   for node in tree.body), f"PUBLIC_API names {name} in {path}, which defines no such thing"


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


def test_the_runtime_pass_finds_what_only_a_test_uses(tmp_path):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rollout" / "part.py").write_text(
        "__all__ = ['used_by_the_runtime', 'used_by_a_test', 'named_by_a_config']\n\n\n"
        "def used_by_the_runtime():\n    return 1\n\n\n"
        "def used_by_a_test():\n    return used_by_the_runtime()\n\n\n"
        "def named_by_a_config():\n    return 2\n")
    (tmp_path / "tests" / "test_part.py").write_text("from rollout.part import used_by_a_test\n\n"
                                                       "def test_part():\n    used_by_a_test()\n")
    assert unused_definitions(tmp_path, public_api={("rollout/part.py", "named_by_a_config")}) == []
    found = unused_definitions(tmp_path, users=("rollout",), public_api={("rollout/part.py", "named_by_a_config")})
    assert [line.split(": ", 1)[1].split(" (")[0] for line in found] == ["unused function 'used_by_a_test'"]
