"""Imports run one way: recipes -> builder -> blocks -> kernels; inside ``builder`` and ``recipes``
no module imports one that imports it back (no import circle); builder's spec pipeline and
analysis never import torch, Lightning or ``recipes``, however deep; blocks/configs and the
registry are torch-free; the CLI finds the recipes' commands through the ``yamlformer.commands``
entry point, without builder importing recipes.

Every import counts, at any depth of a module (inside functions too), as an AST walk reads it:
``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``; a package's
``__init__`` importing its children imports them.
"""

from __future__ import annotations

import ast
import graphlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "blocks", "builder", "recipes")
#: package -> the packages it may not import (at any depth, inside functions too)
FORBIDDEN = {
    "kernels": {"blocks", "builder", "recipes"},
    "blocks": {"builder", "recipes"},
    "builder": {"recipes"},
}
TORCH_FREE = [ROOT / "blocks" / "registry.py", *sorted((ROOT / "blocks" / "configs").glob("*.py"))]
#: builder's subpackages that import neither torch, Lightning nor recipes, through anything they import
PURE = ("yamlformer.builder.spec", "yamlformer.builder.analysis")
HEAVY = {"torch", "lightning", "recipes"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@cache
def _modules() -> dict[str, Path]:
    """Every module of our packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def _imported(module: str) -> frozenset[str]:
    """What ``module`` imports: our modules by dotted name, anything else by its top-level name."""
    modules = _modules()
    path = modules[module]
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            ours = target
            while ours and ours not in modules:
                ours = ours.rpartition(".")[0]
            out.add(ours or target.split(".")[0])
    out.discard(module)
    return frozenset(out)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imports(path) & FORBIDDEN[package]
    }
    assert not wrong, f"{package} imports what sits above it: {wrong}"


@pytest.mark.parametrize("package", ["builder", "recipes"])
def test_no_import_circle_inside(package):
    inside = {m for m in _modules() if m == package or m.startswith(package + ".")}
    graph = {module: _imported(module) & inside for module in inside}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"{package} has an import circle: {' -> '.join(reversed(exc.args[1]))}")


@pytest.mark.parametrize("subpackage", PURE)
def test_spec_and_analysis_never_reach_torch_or_recipes(subpackage):
    """Through every module they import, at any depth."""
    modules = _modules()
    todo = [m for m in modules if m == subpackage or m.startswith(subpackage + ".")]
    via: dict[str, str] = {module: module for module in todo}  # what imported each module first
    wrong = []
    while todo:
        module = todo.pop()
        for name in sorted(_imported(module)):
            if name in HEAVY or name.partition(".")[0] in HEAVY:
                wrong.append(f"{module} imports {name} (reached from {via[module]})")
            elif name in modules and name not in via:
                via[name] = via[module]
                todo.append(name)
    assert not wrong, wrong


def test_configs_and_registry_are_torch_free():
    assert not [str(p.relative_to(ROOT)) for p in TORCH_FREE if "torch" in _imports(p)]


def test_the_cli_finds_the_recipes_commands_through_the_entry_point():
    import importlib.metadata

    from yamlformer.builder.cli import COMMANDS, GROUP, commands

    declared = {entry.name: entry.value for entry in importlib.metadata.entry_points(group=GROUP)}
    table = commands()
    for name in ("train", "eval", "generate", "tokenize"):
        assert table[name][0] == declared[name] == f"yamlformer.recipes.commands.{name}"
        assert table[name][1]  # a help line, from the module's docstring
    assert not any(module.startswith("recipes") for module, _ in COMMANDS.values())


def test_document_kinds_join_through_the_entry_point():
    from yamlformer.builder.spec.kinds import kinds

    table = kinds()
    assert list(table) == ["spec", "recipe"]  # builder's own first
    assert table["recipe"].launch is not None and table["spec"].launch is None


def test_builder_names_no_recipes_module_in_a_string():
    """The one-way rule is not kept by module names in strings (``"yamlformer.recipes.commands"``), which an
    import walk cannot see."""
    named = {
        str(path.relative_to(ROOT)): node.value
        for path in sorted((ROOT / "builder").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"recipes(\.\w+)+(:\w+)?", node.value)
    }
    assert not named, named
