"""Meta-tests (datasette's pattern): every hook spec is documented in docs/plugin_hooks.md with its arguments, and
every hook has a ``test_hook_<name>`` test."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rlpost.core import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name in hookspecs.__all__ if name.startswith("rlpost_")]


def test_every_spec_is_exported():
    defined = {n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("rlpost_")}
    assert defined == set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_arguments(hook):
    doc = (ROOT / "docs" / "plugin_hooks.md").read_text()
    args = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert f"### {hook}({args})" in doc, f"docs/plugin_hooks.md lacks a heading '### {hook}({args})'"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_docstring_with_params(hook):
    fn = getattr(hookspecs, hook)
    doc = inspect.getdoc(fn) or ""
    for arg in inspect.signature(fn).parameters:
        assert f":param {arg}:" in doc, f"{hook} docstring does not document {arg}"


def _test_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_"):
                names.add(node.name)
    return names


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    names = _test_names()
    assert any(n == f"test_hook_{hook}" or n.startswith(f"test_hook_{hook}_") for n in names), (
        f"no test named test_hook_{hook}[_...] in tests/"
    )
