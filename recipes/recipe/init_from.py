"""What a recipe's ``model.init_from`` names, and the model it starts from: a run's checkpoint,
a model folder (``builder import-hf``'s, or Hugging Face's), or a recipe (a file, or a zoo recipe
by name), whose run's last checkpoint it is: one not trained yet is refused by the run and its dry
run, and checked with that recipe's spec by validate (``yamlformer.recipes.training.resolved``).
Torch-free."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from yamlformer.builder.init_from import Source, SourceError, source_at
from yamlformer.builder.kinds import kind_of
from yamlformer.builder.spec.loader import read_merged
from yamlformer.builder.zoo import find
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import resolve


def init_from_source(located) -> Source | None:
    """The ``model.init_from`` of ``located`` (a recipe as loaded; None when it has none), resolved
    to the model it names (:func:`yamlformer.builder.init_from.source_at`); a path that is none of
    the kinds a run starts from is a :class:`RecipeError` naming the field. Asked once per
    resolution: the :class:`yamlformer.recipes.training.resolved.Run` keeps it."""
    if located.recipe.model.init_from is None:
        return None
    with init_from_errors():
        return source_at(init_from_path(located.recipe.model.init_from, located.file))


def init_from_path(value: str, recipe_file: Path | None) -> Path:
    """The path ``model.init_from: value`` names (relative to the recipe file): a checkpoint or a
    model folder as it is; a recipe (:func:`recipe_run`) as its run's last checkpoint, a
    :class:`RecipeError` saying to train it first when there is none (so a run, and its dry run,
    refuse it)."""
    run = recipe_run(value, recipe_file)
    if run is None:
        return resolve(recipe_file, value)
    if not run[1].exists():
        raise RecipeError(
            f"model.init_from: {value} is a recipe, and its run has no checkpoint at {run[1]} yet; train it "
            f"first (builder train {value}), from this folder"
        )
    return run[1]


def recipe_run(value: str | None, recipe_file: Path | None) -> tuple[Path, Path] | None:
    """When ``model.init_from: value`` names a recipe (a file, or a zoo recipe by name): ``(that
    recipe's file, the last checkpoint its run writes from this working directory)``, the run's
    output folder as ``builder train`` names it (``trainer.output_dir``, else ``runs/<name>``);
    else None."""
    if value is None:
        return None
    path = resolve(recipe_file, value)
    entry = find(value) if not path.exists() else None
    named = path if path.is_file() and path.suffix in (".yaml", ".yml") else entry.path if entry else None
    if named is None:
        return None
    data = read_merged(named).data
    kind = kind_of(data)
    if kind is None or kind.name != "recipe":
        return None
    folder = (data.get("trainer") or {}).get("output_dir") or Path("runs") / (data.get("name") or named.stem)
    return named, Path(folder) / "checkpoints" / "last.ckpt"


@contextlib.contextmanager
def init_from_errors():
    """A ``model.init_from`` that cannot be read as one line naming the field."""
    try:
        yield
    except SourceError as exc:
        raise RecipeError(f"model.init_from: {exc}") from None


def spec_base(spec: dict[str, Any], label: str) -> tuple[dict[str, Any], str]:
    """A spec (as data) as the base a recipe's overrides are laid over, and the label its values are
    located at (an unset ``extends`` left out: an inline spec cannot extend)."""
    return {k: v for k, v in spec.items() if not (k == "extends" and v is None)}, label
