"""Imports run one way: recipes -> builder -> blocks -> kernels; blocks/configs and the registry
are torch-free; the CLI finds the recipes' commands without builder importing recipes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package -> the packages it may not import (at any depth, inside functions too)
FORBIDDEN = {
    "kernels": {"blocks", "builder", "recipes"},
    "blocks": {"builder", "recipes"},
    "builder": {"recipes"},
}
TORCH_FREE = [ROOT / "blocks" / "registry.py", *sorted((ROOT / "blocks" / "configs").glob("*.py"))]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imports(path) & FORBIDDEN[package]
    }
    assert not wrong, f"{package} imports what sits above it: {wrong}"


def test_configs_and_registry_are_torch_free():
    assert not [str(p.relative_to(ROOT)) for p in TORCH_FREE if "torch" in _imports(p)]


def test_the_cli_finds_the_recipes_commands():
    from builder.cli import COMMANDS, commands

    table = commands()
    assert {name: table[name][0] for name in ("train", "eval", "generate")} == {
        "train": "recipes.commands.train",
        "eval": "recipes.commands.eval",
        "generate": "recipes.commands.generate",
    }
    assert not any(module.startswith("recipes") for module, _ in COMMANDS.values())
