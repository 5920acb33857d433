"""What a YAML file is — a model spec or a training recipe — told apart by its content. Torch-free.

Each kind of document is a :class:`Kind`: the top-level keys only it has, how to validate one,
its JSON Schema, the fields that name other files, the folder of its shipped files (the zoo,
``yamlformer.builder.zoo``), the model a file describes (``builder list``) and, for a file ``builder
train`` runs, the settings a launch plan gives it (``builder plan``). Every kind joins through
the ``yamlformer.kinds`` entry-point group (``[project.entry-points."yamlformer.kinds"]`` in a
package's ``pyproject.toml``, ``name = "package.module:KIND"``): builder's own spec
(``builder/spec/kind.py``) as any other package's (the recipes' training recipe,
``recipes/commands/kind.py``), so this module imports none of them.

``builder validate`` checks a file as the kind its keys say; a command that wants one kind and
is given another says so in one line (:func:`mistaken`) instead of reporting every key.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: packages add kinds here: ``[project.entry-points."yamlformer.kinds"]``, ``name = "module:KIND"``
GROUP = "yamlformer.kinds"
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
    validate: Callable[[Path, Mapping[str, Any]], list]  # of yamlformer.builder.spec.source.Problem
    #: the JSON Schema of a file of this kind (draft-07)
    schema: Callable[[], dict]
    #: what to do with a file of this kind, said when another command is given one
    hint: Callable[[str], str]
    #: the fields that name another file (a path relative to the file, or a zoo name)
    references: tuple[tuple[str | int, ...], ...] = (("extends",),)
    #: the shipped files of this kind (``None``: none) and whether sub-folders count
    folder: Callable[[], Path | None] = lambda: None
    recursive: bool = False
    #: ``(path) -> (spec, facts)``: the validated ``ModelSpec`` a file describes and what
    #: ``builder list`` shows of the file itself (``family``; ``approximate``: the parameter count
    #: is a stand-in's); ``None``: its files describe no model
    model: Callable[[Path], tuple[Any, dict]] | None = None
    #: ``(document, launch) -> ["key=value", ...]``: the ``--set`` values that make a file of this
    #: kind (``document``: its merged, unvalidated mapping) train as ``launch``
    #: (``yamlformer.builder.analysis.plan.Launch``) says; ``None``: ``builder train`` runs no such file
    launch: Callable[[Mapping[str, Any], Any], list[str]] | None = None


@functools.cache
def kinds() -> dict[str, Kind]:
    """Every kind by name (the ``yamlformer.kinds`` entry points), builder's own first.

    A checkout that was never installed has no entry points, so no kinds: files are then read
    as what a command expects, and zoo names are not found (``yamlformer.builder.packages.NOT_INSTALLED``)."""
    found: dict[str, Kind] = {}
    entries = importlib.metadata.entry_points(group=GROUP)
    own = __name__.removesuffix(".kinds") + "."  # builder's own first: a zoo name a spec has stays the spec's
    for entry in sorted(entries, key=lambda e: not e.module.startswith(own)):
        kind = entry.load()
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
    table = kinds()
    if kind is None or kind.name == wanted or wanted not in table:
        return None
    return f"this is {kind.title}, not {table[wanted].title}: {kind.hint(shown)}"
