"""Tasks are one protocol: every task in the registry is a folder of ``recipes/tasks/`` whose
``TASK`` answers the contract, and nothing outside the registry branches on a task's name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _names():
    from yamlformer.recipes.tasks import NAMES

    return NAMES


@pytest.mark.parametrize("name", _names())
def test_every_task_answers_the_contract(name):
    from yamlformer.recipes.recipe.sections import Recipe
    from yamlformer.recipes.tasks import task_named
    from yamlformer.recipes.tasks.task import Resolution, Task

    task = task_named(name)
    assert isinstance(task, Task) and task.name == name
    assert (ROOT / "recipes" / "tasks" / name / "__init__.py").is_file()
    assert issubclass(task.recipe, Recipe)
    assert task.recipe.model_fields["task"].default == name
    for method in ("prepare", "evaluate"):  # what every task must say for itself
        assert getattr(type(task), method) is not getattr(Task, method), f"{name} does not implement {method}"
    assert issubclass(task.resolution, Resolution) and task.resolution is not Resolution, name
    assert task.resolution.add_files is not Resolution.add_files, f"{name}'s resolution names no files"


def test_the_eval_and_generate_options_of_the_tasks_are_options_of_the_commands():
    import argparse

    from yamlformer.recipes.commands import eval as eval_command
    from yamlformer.recipes.commands import generate as generate_command
    from yamlformer.recipes.tasks import NAMES, task_named

    for command, field in ((eval_command, "eval_options"), (generate_command, "generate_options")):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        dests = {action.dest for action in parser._actions}
        for name in NAMES:
            assert set(getattr(task_named(name), field)) <= dests, (name, field)


def test_task_facades_are_torch_free():
    """A task's facade (its recipe schema, shapes, files) loads without torch, so ``builder
    validate`` and ``builder list`` stay fast; its training code is imported when it trains."""
    code = (
        "import sys\nfrom yamlformer.recipes.tasks import NAMES, task_named\n"
        "[task_named(n) for n in NAMES]\nprint('torch' in sys.modules, 'lightning' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.stdout.split() == ["False", "False"], run.stdout + run.stderr


def _task_name_branches(path: Path, names: set[str]) -> list[str]:
    """``x.task == "mlm"``, ``task in ("lm", "mlm")``, ``match task: case "lm"``: a comparison of
    something called task with a task's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = {
                c.value
                for side in sides
                for c in ([side] if isinstance(side, ast.Constant) else getattr(side, "elts", []))
                if isinstance(c, ast.Constant)
            }
            if literals & names and "task" in ast.unparse(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Match) and "task" in ast.unparse(node.subject):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: match {ast.unparse(node.subject)}")
    return found


def test_no_branch_on_a_task_name_outside_the_task_registry():
    names = set(_names())
    tasks = ROOT / "recipes" / "tasks"
    found = [
        line
        for package in ("recipes", "builder")
        for path in sorted((ROOT / package).rglob("*.py"))
        if tasks not in path.parents
        for line in _task_name_branches(path, names)
    ]
    assert not found, "\n".join(found)
