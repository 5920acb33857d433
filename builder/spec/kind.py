"""The model spec as a kind of document (``yamlformer.builder.kinds``). Torch-free.

It joins the kinds through the ``yamlformer.kinds`` entry point as the recipes' training recipe
does (``recipes/commands/kind.py``): ``builder validate`` checks a spec through :data:`KIND`,
``builder schema`` prints its JSON Schema, the zoo's specs are the spec folder's ``*.yaml`` at any
depth, and ``builder list`` counts the model a spec file is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.kinds import Kind
from yamlformer.builder.spec.json_schema import spec_json_schema
from yamlformer.builder.spec.loader import load_spec, validate_file
from yamlformer.builder.spec.schema import ModelSpec
from yamlformer.builder.spec.source import Problem
from yamlformer.builder.zoo import spec_folder


def _keys() -> frozenset[str]:

    return frozenset(ModelSpec.model_fields)


def _validate(path: Path, overrides: Mapping[str, Any]) -> list[Problem]:

    return validate_file(path, overrides)


def _schema() -> dict:

    return spec_json_schema()


def _hint(shown: str) -> str:
    return (
        f"describe it with `builder describe {shown}`; train it with a recipe whose model.spec names it "
        f"(`builder train lm-stdlib --set model.spec={shown}`, or `builder cp lm-stdlib my-recipe.yaml` "
        "and edit model.spec)"
    )


def _folder() -> Path | None:

    return spec_folder()


def _model(path: Path) -> tuple[Any, dict]:

    return load_spec(path), {}


KIND = Kind(
    name="spec",
    title="a model spec",
    keys=_keys,
    validate=_validate,
    schema=_schema,
    hint=_hint,
    folder=_folder,
    recursive=True,
    model=_model,
)
