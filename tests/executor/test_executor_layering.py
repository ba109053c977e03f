"""DESIGN.md §2: the executor sits between the engine and the runner and never imports torch
at module level (the real runner is built lazily, in whichever process runs it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXECUTOR = Path(__file__).resolve().parents[2] / "pagedllm" / "executor"
HEAVY = {"torch", "numpy", "transformers"}


def _top_level_imports(tree: ast.Module) -> list[str]:
    roots, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            roots += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.append((node.module or "").split(".")[0])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
    return roots


@pytest.mark.parametrize("path", sorted(EXECUTOR.glob("*.py")), ids=lambda p: p.name)
def test_no_heavy_import_at_module_level(path):
    assert not HEAVY & set(_top_level_imports(ast.parse(path.read_text()))), path.name


def test_the_check_sees_the_executor():
    assert {"multiproc.py", "uniproc.py", "wire.py", "worker.py"} <= {p.name for p in EXECUTOR.glob("*.py")}
