"""Imports show the design. The four packages run one way, recipes -> builder -> blocks -> kernels;
inside each, its parts sit in a declared order (:data:`LAYERS`), bottom first, and a part imports
only the parts below it; no module imports one that imports it back (no import circle); builder's
spec pipeline and analysis never import torch, Lightning or ``recipes``, however deep; blocks/configs
and the registry are torch-free; the CLI finds the recipes' commands through the
``yamlformer.commands`` entry point, without builder importing recipes.

Every import counts: at the top of a module and inside its functions alike (a circle hidden inside
a function is still a circle), read from the source as an AST walk sees it. ``from pkg import
name`` imports ``pkg.name`` when that is a module, else ``pkg``; a package's ``__init__`` importing
its children imports them. A local import carries its reason (a torch-free module, a fast command
start, an optional extra) in a comment (:func:`test_every_local_import_says_why`).
"""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the import root the repository's folders install under (yamlformer.builder.packages)
PREFIX = "yamlformer."
PACKAGES = ("kernels", "blocks", "builder", "recipes")
#: package -> the packages it may not import (at any depth, inside functions too)
FORBIDDEN = {
    "kernels": {"blocks", "builder", "recipes"},
    "blocks": {"builder", "recipes"},
    "builder": {"recipes"},
}
#: each package's parts, bottom first: a part imports only the parts before it. A part is a
#: subpackage or a module directly in the package (``blocks``: each module, ``configs`` one
#: part), or the package's own ``__init__`` (builder's: its public API, which the CLI reads).
LAYERS = {
    "kernels": [
        "masks",  # what one attention call masks, as one frozen value (torch only)
        "flash_kernels",  # the shared Triton helpers (and the interpreter's set-up)
        "flash_forward",
        "flash_backward_dq",
        "flash_backward",
        "flash_decode",
        "tuning",  # each launch's config: the shipped table, the cache, the timing
        "flash_launch",
        "triton_attention",  # the custom op
        "attention",
        "__init__",
    ],
    "blocks": [
        "registrable",  # torch-free, imports nothing of ours: the one registry every registered kind is
        "registry",  # torch-free: the block kinds and what each type string builds
        "limits",
        "configs",  # torch-free: every block's fields, checks and counts (they register themselves)
        "init",
        "linear",  # the linear layer every block builds, adapted or NF4, and its contract with an adapter
        "adapters",  # LoRA and DoRA, the modules fine-tuning adds to a linear layer (keeping that contract)
        "tensor_parallel",
        "norms",
        "positions",
        "embeddings",
        "cache",
        "attention",
        "differential",
        "mla",
        "experts",
        "ffn",
        "heads",
        "layers",
        "build",
        "mtp",
        "generation",
        "stacks",
        "__init__",  # loads configs, so the built-in blocks are registered with the package
    ],
    "builder": [
        "packages",  # which installs are ours
        "paths",  # what a path a user gives is: a readable file (or folder), or why not
        "outputs",  # where a command may write: never over what it reads
        "kinds",  # the kinds of YAML document (specs, recipes), found by entry point
        "zoo",  # the shipped specs and recipes, by name
        "optim",  # the optimizers a recipe may name: their fields and the state each keeps
        "mesh",  # the device layout a run trains on, and its rank numbering
        "adapters",  # which linear layers a spec's adapters adapt, and which are NF4 (torch-free)
        "tensors",  # every parameter tensor a spec builds, from the blocks' declarations
        "parametrization",  # how each tensor's init, learning rate and output scale with width (muP)
        "spec",  # torch-free: located YAML, merging, the schema
        "analysis",  # torch-free: counts, memory, the planner
        "assemble",  # a spec to a model (torch)
        "checkpoints",
        "hf",
        "gguf",  # GGUF files for llama.cpp, from the Hugging Face families' tensors
        "init_from",
        "measure",  # this machine's GPU measured into a calibration table (torch, the kernels)
        "__init__",  # the public API: load_spec, estimate, build_model (each imported when first asked)
        "cli",
    ],
    "recipes": [
        "errors",  # what every part raises
        "fields",  # what every recipe section is made of
        "say",  # what a run prints, once
        "data",  # the data sections, corpora, tokenizers, windows
        "recipe",  # torch-free: the recipe's sections and its model spec
        "trained",  # a trained model and its tokenizer back from a checkpoint
        "parallel",  # how a model is spread over devices
        "optim",  # the optimizers and the learning-rate schedules a run builds
        "learning",  # the LightningModule every task trains through, and its optimizer
        "tasks",  # each task: its recipe, data, module and evaluation
        "training",  # one run: resolved once, its stages, folder, logs and dry run
        "studies",  # families of runs
        "commands",  # what the recipes add to builder: its commands, the recipe as a kind of document
        "__init__",
    ],
}
TORCH_FREE = [
    ROOT / "blocks" / "registrable.py",
    ROOT / "blocks" / "registry.py",
    *sorted((ROOT / "blocks" / "configs").glob("*.py")),
]
#: what loads without torch or Lightning (what it imports at its top, and that at its top, ...): the
#: command line, the recipe and spec files, each task's recipe and Task, the resolution a dry run
#: and builder validate go through, the checkpoint and Hugging Face readers until they read, and the
#: signals' handlers builder train installs as it starts
LOADS_WITHOUT_TORCH = (
    "yamlformer.builder",
    "yamlformer.builder.cli.*",
    "yamlformer.builder.kinds",
    "yamlformer.builder.zoo",
    "yamlformer.builder.spec.*",
    "yamlformer.builder.analysis.*",
    "yamlformer.builder.checkpoints.*",
    "yamlformer.builder.hf.*",
    "yamlformer.builder.init_from",
    "yamlformer.recipes.commands.*",
    "yamlformer.recipes.recipe.*",
    "yamlformer.recipes.tasks",
    "yamlformer.recipes.tasks.task",
    "yamlformer.recipes.tasks.files",
    "yamlformer.recipes.tasks.json_schema",
    "yamlformer.recipes.tasks.lm",
    "yamlformer.recipes.tasks.mlm",
    "yamlformer.recipes.tasks.translation",
    "yamlformer.recipes.tasks.classification",
    "yamlformer.recipes.tasks.preference",
    "yamlformer.recipes.tasks.sft",
    "yamlformer.recipes.tasks.sft.records",
    "yamlformer.recipes.data.records",
    "yamlformer.recipes.training.resolved",
    "yamlformer.recipes.training.resume",
    "yamlformer.recipes.training.run_folder",
    "yamlformer.recipes.training.dry_run",
    "yamlformer.recipes.training.signals",
    "yamlformer.recipes.training.requeue",
)
#: builder's subpackages that import neither torch, Lightning nor recipes, through anything they import
PURE = ("yamlformer.builder.spec", "yamlformer.builder.analysis")
HEAVY = {"torch", "lightning", "yamlformer.recipes"}


@cache
def _modules() -> dict[str, Path]:
    """Every module of our packages by its import name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[PREFIX + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def _import_nodes(module: str) -> tuple[tuple[ast.stmt, list[str], bool], ...]:
    """``(node, what it imports, inside a function)`` for every import statement of ``module``:
    our modules by import name, anything else by its top-level name."""
    modules = _modules()
    path = modules[module]
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    local = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        names = []
        for target in targets:
            ours = target
            while ours and ours not in modules:
                ours = ours.rpartition(".")[0]
            names.append(ours if ours.startswith(PREFIX) else target.split(".")[0])
        out.append((node, sorted(set(names) - {module}), id(node) in local))
    return tuple(out)


def _imported(module: str) -> frozenset[str]:
    return frozenset(name for _, names, _ in _import_nodes(module) for name in names)


def _package(module: str) -> str:
    return module.removeprefix(PREFIX).split(".")[0]


def _part(module: str) -> str:
    """The part of its package ``module`` belongs to (``__init__``: the package's own)."""
    rest = module.removeprefix(PREFIX).split(".")[1:]
    return rest[0] if rest else "__init__"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    wrong = {
        str(path.relative_to(ROOT)): sorted(
            {_package(n) for n in _imported(m) if n.startswith(PREFIX)} & FORBIDDEN[package]
        )
        for m, path in sorted(_modules().items())
        if _package(m) == package and {_package(n) for n in _imported(m) if n.startswith(PREFIX)} & FORBIDDEN[package]
    }
    assert not wrong, f"{package} imports what sits above it: {wrong}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_part_imports_only_the_parts_below_it(package):
    order = LAYERS[package]
    found = {_part(m) for m in _modules() if _package(m) == package}
    assert found == set(order), (
        f"{package}: parts not in LAYERS {sorted(found - set(order))}, gone {sorted(set(order) - found)}"
    )
    wrong = []
    for module in sorted(m for m in _modules() if _package(m) == package):
        for node, names, _ in _import_nodes(module):
            for name in names:
                if name.startswith(PREFIX) and _package(name) == package:
                    part, theirs = _part(module), _part(name)
                    if theirs != part and order.index(theirs) > order.index(part):
                        wrong.append(f"{module} imports {name} (line {node.lineno}): {theirs} is above {part}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside(package):
    inside = {m for m in _modules() if _package(m) == package}
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
            if name in HEAVY or any(name.startswith(heavy + ".") for heavy in HEAVY):
                wrong.append(f"{module} imports {name} (reached from {via[module]})")
            elif name in modules and name not in via:
                via[name] = via[module]
                todo.append(name)
    assert not wrong, wrong


def _loaded_with(module: str) -> dict[str, str]:
    """Every module loading ``module`` loads (its top-level imports, theirs, and each package's
    ``__init__`` on the way), each with the module that imported it."""
    modules = _modules()
    via, todo = {module: module}, [module]
    while todo:
        current = todo.pop()
        parents = [".".join(current.split(".")[:i]) for i in range(2, len(current.split(".")))]
        names = [n for node, found, local in _import_nodes(current) if not local for n in found] + parents
        for name in names:
            if name not in via:
                via[name] = current
                if name in modules:
                    todo.append(name)
    return via


@pytest.mark.parametrize("pattern", LOADS_WITHOUT_TORCH)
def test_what_must_load_without_torch_does(pattern):
    modules = _modules()
    chosen = [m for m in modules if m == pattern or (pattern.endswith(".*") and m.startswith(pattern[:-1]))]
    assert chosen, pattern
    wrong = []
    for module in chosen:
        via = _loaded_with(module)
        for heavy in ("torch", "lightning"):
            if heavy in via:
                chain, at = [heavy], heavy
                while via[at] != at:
                    at = via[at]
                    chain.append(at)
                wrong.append(" <- ".join(chain))
    assert not wrong, "\n".join(wrong)


def test_configs_and_registry_are_torch_free():
    names = {
        p: _imported(PREFIX + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        for p in TORCH_FREE
    }
    assert not [str(p.relative_to(ROOT)) for p, imported in names.items() if "torch" in imported]


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
    from yamlformer.builder.kinds import kinds

    table = kinds()
    assert list(table) == ["spec", "recipe"]  # builder's own first
    assert table["recipe"].launch is not None and table["spec"].launch is None


#: a string that spells one of our modules (``"yamlformer.recipes.optim.muon:muon"``, ``"recipes.commands"``):
#: its package, then its dotted path, then an optional ``:attribute``
_MODULE_STRING = re.compile(rf"(?:{re.escape(PREFIX)})?({'|'.join(PACKAGES)})(?:\.\w+)+(?::\w+)?")


def _module_strings(package: str) -> list[tuple[str, int, str]]:
    """``(file, line, string)`` for every string constant in ``package`` that spells a module of one
    of the packages above it."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = _MODULE_STRING.fullmatch(node.value)
                if match and match.group(1) in FORBIDDEN[package]:
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.value))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_names_an_upper_module_in_a_string(package):
    """The one-way rule is not kept by module names in strings (``"yamlformer.recipes.optim.muon:muon"``
    handed to ``importlib``), which an import walk cannot see: a lower layer names no module of an
    upper one, with or without the ``yamlformer.`` prefix. What it needs from above is registered
    into it by the upper layer (``yamlformer.recipes.optim.implements``) or found by entry point."""
    named = [f"{file}:{line}: {value!r}" for file, line, value in _module_strings(package)]
    assert not named, f"{package} names modules of the layers above it:\n" + "\n".join(named)


def test_a_module_string_is_recognised_with_and_without_the_prefix():
    """The check above reads the spellings it must refuse (and leaves a bare word and prose alone)."""
    for spelled in ("yamlformer.recipes.optim.muon:muon", "recipes.commands", "yamlformer.builder.cli.train"):
        assert _MODULE_STRING.fullmatch(spelled), spelled
    for other in ("recipes", "builder", "the recipes.optim module", "yamlformer"):
        assert not _MODULE_STRING.fullmatch(other), other


def _local_import_groups(path: Path):
    """Runs of import statements, one after another in a block of a function: each run's first one."""
    tree = ast.parse(path.read_text())
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                previous = None
                for statement in block:
                    is_import = isinstance(statement, (ast.Import, ast.ImportFrom))
                    if is_import and not isinstance(previous, (ast.Import, ast.ImportFrom)):
                        yield statement
                    previous = statement


def test_every_local_import_says_why():
    """An import inside a function hides what its module needs, so each one is there for a reason
    it states (a module that must stay torch-free, a command that must start fast, an optional
    extra): a comment on the line above a run of local imports, or on its first line."""
    silent = []
    for path in sorted(_modules().values()):
        lines = path.read_text().splitlines()
        for first in _local_import_groups(path):
            above = lines[first.lineno - 2].strip() if first.lineno > 1 else ""
            if not above.startswith("#") and "#" not in lines[first.lineno - 1]:
                silent.append(f"{path.relative_to(ROOT)}:{first.lineno}")
    assert not silent, "local imports without a reason:\n" + "\n".join(silent)


def test_builder_imports_only_the_command_it_runs():
    """``builder validate`` builds its own subparser only: no other command's module is imported
    (each may then import what it needs at its top), and ``builder --help`` imports none, while
    still listing every command with its help."""
    probe = (
        "import sys, io, contextlib\n"
        "from yamlformer.builder.cli import commands, main\n"
        "table = commands()\n"
        "loaded = lambda: sorted(name for name, (module, _) in table.items() if module in sys.modules)\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(loaded())\n"
        "print(all(name in out.getvalue() for name in table))\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main(['validate', {str(ROOT / 'specs' / 'tiny' / 'llama.yaml')!r}])\n"
        "print(status, loaded())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    helped, listed, validated = done.stdout.splitlines()
    assert helped == "[]", f"builder --help imported command modules: {helped}"
    assert listed == "True", "builder --help does not list every command"
    assert validated == "0 ['validate']", validated
