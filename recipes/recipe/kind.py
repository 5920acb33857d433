"""The training recipe as a kind of document (``builder.spec.kinds``). Torch-free.

``builder validate`` checks a recipe through :data:`KIND` (the recipe, then its model spec with
its overrides and the vocabulary the tokenizer will have); ``builder schema --recipe`` prints
its JSON Schema; the zoo's recipes are the ``recipes`` folder's ``*.yaml``; ``builder list`` summarises
one by its task and its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder.spec.kinds import Kind
from builder.spec.source import Problem, SpecError


def _keys() -> frozenset[str]:
    from recipes.recipe.sections import TASKS, recipe_class

    return frozenset(name for task in TASKS for name in recipe_class(task).model_fields)


def validate(path: Path, overrides: Mapping[str, Any]) -> list[Problem]:
    """Every problem of one recipe file and of the model spec it trains (``[]`` when valid)."""
    from recipes.recipe.sections import RecipeError, load_recipe, model_spec
    from recipes.training.dry_run import missing_inputs, vocabulary

    try:
        recipe = load_recipe(path, dict(overrides))
        recipe_file = recipe_path(path)
        missing = missing_inputs(recipe, recipe_file)
        model_spec(recipe, recipe_file, vocabulary(recipe, recipe_file, read_data=False).size)
    except SpecError as exc:
        return exc.problems
    except RecipeError as exc:
        return [Problem(str(path), None, None, "", str(exc))]
    return [Problem(str(path), None, None, "", line) for line in missing]


def recipe_path(path: str | Path) -> Path:
    """The recipe file ``path`` names: a path, else a zoo name (``lm-stdlib``)."""
    from builder.zoo import ZooError, locate
    from recipes.recipe.sections import RecipeError

    try:
        return locate(path)
    except ZooError as exc:
        raise RecipeError(f"{path}: {exc}") from None


def _hint(shown: str) -> str:
    return (
        f"`builder train {shown} --dry-run` shows its model's estimate and what it would download; "
        f"`builder validate {shown}` checks it"
    )


def _schema() -> dict:
    from recipes.recipe.json_schema import recipe_json_schema

    return recipe_json_schema()


def _summary(path: Path) -> dict:
    from builder.analysis.estimates import estimate
    from recipes.recipe.sections import load_recipe, model_spec
    from recipes.training.dry_run import vocabulary

    recipe = load_recipe(path)
    vocab = vocabulary(recipe, path, read_data=False)
    spec = model_spec(recipe, path, vocab.size)
    return {
        "family": recipe.task,
        "params": estimate(spec, seq_len=1).params.total,
        "model": spec.name,
        "approximate": vocab.stand_in,
    }


KIND = Kind(
    name="recipe",
    title="a training recipe",
    keys=_keys,
    validate=validate,
    schema=_schema,
    hint=_hint,
    references=(("extends",), ("model", "spec")),
    folder=lambda: Path(__file__).resolve().parents[1],  # recipes/*.yaml
    recursive=False,
    summary=_summary,
)
