"""The training recipe as a kind of document (``yamlformer.builder.kinds``). Torch-free.

``builder validate`` checks a recipe through :data:`KIND` (the recipe, then its model spec with
its overrides and the vocabulary the tokenizer will have); ``builder schema --recipe`` prints
its JSON Schema; the zoo's recipes are the ``recipes`` folder's ``*.yaml``; ``builder list`` summarises
one by its task and its model; ``builder plan`` launches one with the settings :func:`_launch`
writes from its plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.kinds import Kind
from yamlformer.builder.optim import DEFAULT as DEFAULT_OPTIMIZER
from yamlformer.builder.spec.source import Problem, SpecError


def _keys() -> frozenset[str]:
    # local: every command that reads a YAML file loads this kind; the recipes load for a recipe only
    from yamlformer.recipes.tasks import NAMES, recipe_class

    return frozenset(name for task in NAMES for name in recipe_class(task).model_fields)


def validate(path: Path, overrides: Mapping[str, Any]) -> list[Problem]:
    """Every problem of one recipe file and of the model spec it trains (``[]`` when valid),
    through the run's resolution without its data read
    (:func:`yamlformer.recipes.training.resolved.resolve_model`)."""
    # local: every command that reads a YAML file loads this kind; the recipes load for a recipe only
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.resolved import resolve_model

    try:
        located = load_recipe(path, dict(overrides))
        resolve_model(located)  # its files first, each problem at its line
    except SpecError as exc:
        return exc.problems
    except RecipeError as exc:
        return [Problem(str(path), None, None, "", str(exc))]
    return []


def _hint(shown: str) -> str:
    return (
        f"`builder train {shown} --dry-run` shows its model's estimate and what it would download; "
        f"`builder validate {shown}` checks it"
    )


def _schema() -> dict:
    # local: every command that reads a YAML file loads this kind; the recipes load for a recipe only
    from yamlformer.recipes.tasks.json_schema import recipe_json_schema

    return recipe_json_schema()


def _model(path: Path) -> tuple[Any, dict]:
    # local: every command that reads a YAML file loads this kind; the recipes load for a recipe only
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.resolved import resolve_model

    located = load_recipe(path)
    _, vocab, spec = resolve_model(located)
    return spec, {"family": located.recipe.task, "approximate": vocab.stand_in}


#: Lightning's precision for a plan's compute dtype
PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32"}


def _launch(document: Mapping[str, Any], launch) -> list[str]:
    """The ``--set KEY=VALUE`` values that make a recipe (``document``, merged, not validated)
    train as ``launch`` (``yamlformer.builder.analysis.plan.Launch``) says; the time limit is lifted, the
    plan's budget being steps."""
    layout = launch.layout
    sets = [f"model.spec={launch.spec}"] if launch.spec else []
    sets += [f"model.overrides.{item}" for item in launch.spec_overrides]
    # local: every command that reads a YAML file loads this kind; the recipes load for a recipe only
    from yamlformer.recipes.tasks import recipe_class, task_named

    task = recipe_class(document.get("task")).model_fields["task"].default  # a value that is no task: the LM's
    sets += [
        *task_named(task).batch_settings(launch.seq_len, launch.batch_size),
        # the runtime's own fields for the layout (yamlformer.builder.analysis.runtime): degrees, schedule, accumulation
        *(f"trainer.{name}={str(value).lower()}" for name, value in launch.trainer_fields.items()),
        f"trainer.devices={layout.per_node}",
        f"trainer.num_nodes={layout.nodes}",
        f"trainer.precision={PRECISION[launch.dtype]}",
    ]
    if launch.optimizer != DEFAULT_OPTIMIZER:  # the state the plan sized (AdamW's, the most, otherwise)
        sets.append(f"optimizer.type={launch.optimizer}")
    if launch.max_steps is not None:
        sets += [f"trainer.max_steps={launch.max_steps}", "trainer.max_time=null"]
    if launch.output_dir is not None:
        sets.append(f"trainer.output_dir={launch.output_dir}")
    return sets


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
    model=_model,
    launch=_launch,
)
