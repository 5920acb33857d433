"""A recipe as loaded (:func:`yamlformer.recipes.tasks.load_recipe`): the validated recipe, the file
it was read from and that file as written, every key and value located. One immutable value that
the resolution (:mod:`yamlformer.recipes.training.resolved`), ``builder validate`` and ``builder
list`` are handed instead of a recipe and its path side by side. Torch-free.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from yamlformer.builder.spec.source import Document
from yamlformer.recipes.fields import resolve
from yamlformer.recipes.recipe.sections import Recipe


@dataclasses.dataclass(frozen=True)
class LocatedRecipe:
    """A validated recipe, where it was read from, and its file as written (``extends:`` merged,
    no ``--set``: where each field was written, for located problems). Never changed: a recipe
    made concrete for this machine is a new one (:meth:`with_recipe`)."""

    recipe: Recipe
    file: Path  # the recipe file: its relative paths start in its folder
    written: Document  # read once, when it was loaded; callers read it and never change it

    @property
    def name(self) -> str:
        """The recipe's ``name``, else its file's stem (what names its run folder)."""
        return self.recipe.name or self.file.stem

    @property
    def out(self) -> Path:
        """Where a run writes: ``trainer.output_dir``, else ``runs/<recipe name>``."""
        return Path(self.recipe.trainer.output_dir or Path("runs") / self.name)

    def path(self, value: str | Path) -> Path:
        """A path the recipe names, relative to its folder."""
        return resolve(self.file, value)

    def mark(self, *key):
        """Where the value at ``key`` (``"model", "freeze", 0``) was written, or None (``--set`` or a default)."""
        return self.written.value_mark(tuple(key))

    def with_recipe(self, recipe: Recipe) -> LocatedRecipe:
        """The same file with ``recipe`` in place of its recipe (``trainer.precision`` made concrete)."""
        return dataclasses.replace(self, recipe=recipe)
