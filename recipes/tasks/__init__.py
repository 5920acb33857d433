"""The tasks a recipe trains, by its ``task:`` value, and a recipe file loaded as its task's. Each
task is a folder here: ``__init__.py`` (torch-free) holds the task's recipe schema and its
:class:`~yamlformer.recipes.tasks.task.Task` (``TASK``), ``training.py`` its data,
LightningModule, evaluation and decoding. A new task is one folder and its name in
:data:`yamlformer.recipes.recipe.sections.TASKS`; nothing else branches on a task's name.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.located import LocatedRecipe
from yamlformer.recipes.recipe.sections import TASKS, read_recipe, read_written, task_written

#: every task, by its ``task:`` value (the folder ``recipes/tasks/<name>/``); ``lm`` is the default
NAMES = TASKS


def task_named(name: str):
    """The :class:`~yamlformer.recipes.tasks.task.Task` called ``name`` (a checkpoint's or a recipe's ``task``)."""
    if name not in NAMES:
        raise RecipeError(f"unknown task {name!r}; one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").TASK


def task_of(meta: dict):
    """The task of a checkpoint's ``builder`` record (``lm`` when it names none: written before tasks)."""
    return task_named(meta.get("task", "lm"))


def recipe_class(task: Any) -> type:
    """The recipe schema of ``task`` (an unknown task, or a value that is no name, gets the LM's,
    whose ``task`` field then reports it with the valid names)."""
    return task_named(task if isinstance(task, str) and task in NAMES else "lm").recipe


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> LocatedRecipe:
    """Load and validate a recipe file (or a zoo recipe by name) as the recipe of the task it
    names (:func:`yamlformer.recipes.recipe.sections.read_recipe`), with its file and that file as
    written (:class:`~yamlformer.recipes.recipe.located.LocatedRecipe`); raises
    ``yamlformer.builder.spec.loader.SpecError`` with located problems."""
    found, written = read_written(path)
    recipe = read_recipe(found, recipe_class(task_written(written, overrides or {})), overrides)
    return LocatedRecipe(recipe, found, written)
