"""What a YAML file is — a model spec or a training recipe — told apart by its content. Torch-free.

Each kind of document is a :class:`Kind`: the top-level keys only it has, how to validate one,
its JSON Schema, the fields that name other files, and the folder of its shipped files (the zoo,
``builder.zoo``). ``builder`` defines the spec; other packages contribute kinds as a ``KIND`` in
a module named in :data:`PROVIDERS` (the recipes' training recipe, in ``recipes/recipe/kind.py``)
or in an installed package's ``builder.spec.kinds`` entry point. Providers are imported by name,
only when asked: ``builder`` does not depend on ``recipes``.

``builder validate`` checks a file as the kind its keys say; a command that wants one kind and
is given another says so in one line (:func:`mistaken`) instead of reporting every key.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from builder.spec.source import FieldPath, Problem

#: modules whose ``KIND`` joins the document kinds, when they can be imported
PROVIDERS = ("recipes.recipe.kind",)
#: installed packages add kinds here: ``[project.entry-points."builder.spec.kinds"]``
GROUP = "builder.spec.kinds"
#: keys every kind may have; they tell nothing apart
SHARED = frozenset({"name", "extends"})


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of document (``spec``, ``recipe``)."""

    name: str
    #: what the kind is, for messages: "a model spec"
    title: str
    #: the top-level keys of this kind (those in :data:`SHARED` tell nothing)
    keys: Callable[[], frozenset[str]]
    #: ``(path, overrides) -> problems``: every problem of one file (``[]`` when valid)
    validate: Callable[[Path, Mapping[str, Any]], list[Problem]]
    #: the JSON Schema of a file of this kind (draft-07)
    schema: Callable[[], dict]
    #: what to do with a file of this kind, said when another command is given one
    hint: Callable[[str], str]
    #: the fields that name another file (a path relative to the file, or a zoo name)
    references: tuple[FieldPath, ...] = (("extends",),)
    #: the shipped files of this kind (``None``: none) and whether sub-folders count
    folder: Callable[[], Path | None] = lambda: None
    recursive: bool = False
    #: ``(path) -> {"family": str, "params": int | None}`` for ``builder list``
    summary: Callable[[Path], dict] | None = None


def _spec_keys() -> frozenset[str]:
    from builder.spec.schema import ModelSpec

    return frozenset(ModelSpec.model_fields)


def _validate_spec(path: Path, overrides: Mapping[str, Any]) -> list[Problem]:
    from builder.spec.loader import validate_file

    return validate_file(path, overrides)


def _spec_schema() -> dict:
    from builder.spec.json_schema import spec_json_schema

    return spec_json_schema()


def _spec_hint(shown: str) -> str:
    return (
        f"describe it with `builder describe {shown}`; train it with a recipe whose model.spec names it "
        f"(`builder train lm-stdlib --set model.spec={shown}`, or `builder cp lm-stdlib my-recipe.yaml` "
        "and edit model.spec)"
    )


def _spec_folder() -> Path | None:
    from builder.zoo import spec_folder

    return spec_folder()


def _spec_summary(path: Path) -> dict:
    from builder.analysis.estimates import estimate
    from builder.hf import Unsupported, choose_family
    from builder.spec.loader import load_spec

    spec = load_spec(path)
    try:
        family = choose_family(spec)[0].model_type
    except Unsupported:
        family = spec.architecture
    return {"family": family, "params": estimate(spec, seq_len=1).params.total}


SPEC = Kind(
    name="spec",
    title="a model spec",
    keys=_spec_keys,
    validate=_validate_spec,
    schema=_spec_schema,
    hint=_spec_hint,
    folder=_spec_folder,
    recursive=True,
    summary=_spec_summary,
)


def kinds() -> dict[str, Kind]:
    """Every kind by name: the spec, then the providers', then installed entry points'."""
    found = {SPEC.name: SPEC}
    for provider in PROVIDERS:
        if importlib.util.find_spec(provider.partition(".")[0]) is not None:
            kind = importlib.import_module(provider).KIND
            found.setdefault(kind.name, kind)
    for entry in importlib.metadata.entry_points(group=GROUP):
        kind = importlib.import_module(entry.value).KIND
        found.setdefault(kind.name, kind)
    return found


def kind_of(data: Any) -> Kind | None:
    """The kind whose keys ``data`` (a merged document) has most of; ``None`` when it has none
    of any kind's (or as many of two kinds')."""
    if not isinstance(data, dict):
        return None
    scores = sorted(
        ((len((kind.keys() - SHARED) & data.keys()), kind) for kind in kinds().values()), key=lambda pair: -pair[0]
    )
    if not scores or scores[0][0] == 0 or (len(scores) > 1 and scores[1][0] == scores[0][0]):
        return None
    return scores[0][1]


def mistaken(data: Any, wanted: str, shown: str) -> str | None:
    """One line when ``data`` is plainly another kind of document than ``wanted`` (``None`` else):
    ``x.yaml is a training recipe, not a model spec: ...``."""
    kind = kind_of(data)
    if kind is None or kind.name == wanted:
        return None
    return f"this is {kind.title}, not {kinds()[wanted].title}: {kind.hint(shown)}"
