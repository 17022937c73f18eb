"""No module of the runtime packages writes the environment when it is imported: every os.environ write
(assignment, setdefault, update, pop, os.putenv) sits inside a function called at start-up
(e.g. spillover.infra.ray_env.set_loopback_env, spillover.infra.prefect.env.apply_process_defaults)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "rollout", "infra")
_WRITES = {"setdefault", "update", "pop", "clear", "__setitem__"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _module_level_env_writes(tree: ast.Module) -> list[int]:
    """Line numbers of environment writes outside any function body (classes and if-blocks included)."""
    lines = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines.extend(node.lineno for t in targets if isinstance(t, ast.Subscript) and _is_environ(t.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr in _WRITES and _is_environ(node.func.value)) or node.func.attr == "putenv":
                lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return lines


def test_the_scanner_sees_a_module_level_write():
    code = "import os\nos.environ.setdefault('A', '1')\ndef f():\n    os.environ['B'] = '2'\nos.environ['C'] = '3'\n"
    assert _module_level_env_writes(ast.parse(code)) == [2, 5]


def test_no_runtime_module_writes_the_environment_at_import():
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            lines = _module_level_env_writes(ast.parse(path.read_text(), str(path)))
            if lines:
                found[str(path.relative_to(REPO))] = lines
    assert found == {}
