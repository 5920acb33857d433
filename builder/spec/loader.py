"""Loading specs: located YAML, ``extends:`` chains, ``--set`` overrides, located errors.

``load_spec("specs/llama/llama2-7b.yaml", overrides={"decoder.n_layers": 2})`` returns the
validated ``ModelSpec``, or raises :class:`SpecError` listing every problem in the file as
``file:line:col: field.path: message``. ``load_config`` runs the same machinery for any
pydantic model (recipes use it). Nothing here imports torch.

Order of application: the ``extends:`` chain (parent first), then the overrides (each located
as ``<--set key=value>`` unless the caller says where it was written), then validation. Every
layering goes through the one merge (``yamlformer.builder.spec.merge``): mappings merge key by key, scalars and
lists replace, and a block mapping whose ``type`` differs from the one under it replaces it. An
override sets the value at its dotted path, a mapping merged over a mapping already there.
``name`` defaults to the file's stem when the file itself does not set it.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.spec.merge import Source, merge
from yamlformer.builder.spec.problems import validation_problems
from yamlformer.builder.spec.schema import DEFAULT_TYPES, ModelSpec, spec_model
from yamlformer.builder.spec.source import (
    Document,
    FieldPath,
    Mark,
    Problem,
    SpecError,
    parse_document,
    parse_value,
    read_bounded,
)
from yamlformer.builder.zoo import ZooError, locate, name_of, shown

__all__ = [
    "Problem",
    "SpecError",
    "load_spec",
    "load_config",
    "validate_file",
    "parse_set_args",
    "read_merged",
    "apply_overrides",
    "validate_document",
]


def load_spec(
    spec: str | os.PathLike | Mapping[str, Any] | Any,
    overrides: Mapping[str, Any] | None = None,
    plugins: Iterable[str] = (),
    sources: Mapping[str, Source] | None = None,
):
    """Load, merge and validate a model spec; raises :class:`SpecError` with every problem.

    ``spec``: a path to a YAML file (``str`` or ``os.PathLike``), a mapping of spec fields (as
    ``yaml.safe_load`` gives it; an ``extends:`` in it is read relative to the working folder), or
    a validated ``ModelSpec`` (returned as it is, or with the overrides applied).
    ``overrides``: ``{"decoder.n_layers": 2}``, applied after ``extends:``.
    ``sources``: where an override was written, by key (see :func:`apply_overrides`)."""
    # local: plugins are found through entry points (importlib.metadata, ~80 ms), only when given
    from yamlformer.builder.spec.plugins import load_plugins

    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides takes a mapping of dotted keys to values ({{'decoder.n_layers': 2}}), "
            f"got {type(overrides).__name__}"
        )
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Iterable):
        raise TypeError(f"plugins takes a list of module names, got {type(plugins).__name__}")
    load_plugins(plugins)
    if isinstance(spec, ModelSpec):
        if not overrides:
            return spec
        spec = spec.model_dump(exclude={"extends"})
    if isinstance(spec, Mapping):
        return _load_mapping(spec, spec_model(), overrides)
    return _load(_path_of(spec, "load_spec"), spec_model(), overrides, default_name=True, sources=sources, kind="spec")


def load_config(path: str | Path, model_cls: type, overrides: Mapping[str, Any] | None = None, kind: str | None = None):
    """Load any YAML config into ``model_cls`` (a pydantic model) with the same located errors.
    ``kind``: the document kind expected (``yamlformer.builder.kinds``); a file plainly of another kind
    is one problem saying so, not one per key."""
    return _load(path, model_cls, overrides, default_name=False, kind=kind)


def validate_file(path: str | Path, overrides: Mapping[str, Any] | None = None, plugins: Iterable[str] = ()):
    """Every problem of one spec file (an empty list when it is valid)."""
    try:
        load_spec(path, overrides, plugins)
    except SpecError as exc:
        return exc.problems
    return []


def parse_set_args(items: Iterable[str]) -> dict[str, Any]:
    """``["decoder.n_layers=2", ...]`` to ``{"decoder.n_layers": 2}``, values read as YAML."""
    overrides: dict[str, Any] = {}
    problems = []
    for item in items:
        where = Mark(f"<--set {item}>")
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(Problem.at(where, key, "expected --set dotted.key=value, e.g. decoder.n_layers=2"))
            continue
        try:
            overrides[key] = parse_value(text)
        except SpecError as exc:
            problems.append(Problem.at(where, key, exc.problems[-1].message))
        except Exception as exc:
            problems.append(Problem.at(where, key, f"not a YAML value: {str(exc).splitlines()[0]}"))
    if problems:
        raise SpecError(problems)
    return overrides


def read_merged(
    path: str | Path,
    overrides: Mapping[str, Any] | None = None,
    sources: Mapping[str, Source] | None = None,
    model_cls: type | None = None,
) -> Document:
    """The file after its ``extends:`` chain and the overrides, not validated yet. ``path`` may
    be a zoo name (``llama3-8b``); a file that exists wins (``yamlformer.builder.zoo``).

    ``model_cls``: what the file should be; a file of the chain whose top-level keys are none of
    its fields is refused whole (nothing of it quoted)."""
    path, display = locate_file(path)
    doc = _resolve(path, display, _fields_of(model_cls), _kind_of(model_cls))
    doc.data.pop("extends", None)  # resolved: the merged document holds every field
    apply_overrides(doc, overrides, sources)
    return doc


def locate_file(path: str | Path) -> tuple[Path, str]:
    """The file ``path`` names (a path, else a zoo name: ``yamlformer.builder.zoo``) and how messages show
    it; raises :class:`SpecError` for neither, with the closest zoo names."""

    try:
        found = locate(path)
    except ZooError as exc:
        raise SpecError([Problem(str(path), None, None, "", str(exc))]) from None
    return found, str(path) if found == Path(path) and not found.is_absolute() else shown(found)


def _fields_of(model_cls: type | None) -> list[str] | None:
    """The top-level keys of ``model_cls``, required first (a refusal lists the first few)."""
    if model_cls is None:
        return None
    return sorted(model_cls.model_fields, key=lambda f: not model_cls.model_fields[f].is_required())


def apply_overrides(
    doc: Document, overrides: Mapping[str, Any] | None, sources: Mapping[str, Source] | None = None
) -> None:
    """Set each dotted key of ``overrides`` in ``doc`` (a mapping merges over a mapping there).

    ``sources``: where an override was written (a recipe's ``model.overrides`` line), by key;
    others are located as ``<--set key=value>``. Raises :class:`SpecError` with every problem.
    """
    problems = []
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not key:
            problems.append(
                Problem.at(
                    Mark(f"<--set {key!r}>"),
                    str(key),
                    "an override's key is a dotted field path, a non-empty string such as 'decoder.n_layers'",
                )
            )
            continue
        if key.split(".")[0] == "extends":
            problems.append(
                Problem.at(
                    Mark(f"<--set {key}>"),
                    key,
                    "extends is read from the file before --set applies; "
                    "write `extends:` in the file (or a new file that extends it)",
                )
            )
            continue
        try:
            _apply_override(doc, key, value, (sources or {}).get(key))
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError(doc.problems + problems)


def validate_document(doc: Document, model_cls: type, first: str | None = None):
    """Validate a located document as ``model_cls``; raises :class:`SpecError` with every problem,
    ``first``'s (a file name) first, in line order."""
    if "extends" in doc.data and "extends" not in model_cls.model_fields:
        del doc.data["extends"]
    spec, problems = validation_problems(model_cls, doc.data, doc)
    problems = doc.problems + problems
    if problems:
        # this file's problems first, in line order; then its parents'; then --set
        order = lambda p: (p.line is None, p.file != first, p.file, p.line or 0, p.col or 0)
        raise SpecError(sorted(problems, key=order))
    return spec


def _path_of(value: Any, function: str) -> str | os.PathLike:
    """``value`` as a path, or a ``TypeError`` saying what ``function`` takes."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        if isinstance(value, str) and "\n" in value:
            raise TypeError(
                f"{function} takes a path, not YAML text; parse it first "
                f"({function}(yaml.safe_load(text)) takes the mapping)"
            )
        return value
    raise TypeError(
        f"{function} takes a path to a spec file (str or os.PathLike), a mapping of spec fields "
        f"or a ModelSpec, got {type(value).__name__}"
    )


def _load_mapping(data: Mapping[str, Any], model_cls: type, overrides) -> Any:
    """Validate a mapping given in Python (no file: problems are located as ``<mapping>``)."""

    mark = Mark("<mapping>")
    doc = Document(copy.deepcopy(dict(data)), {}, {(): mark})
    parent = doc.data.pop("extends", None)
    if parent is not None:  # a parent of a mapping is read relative to the working folder
        if not isinstance(parent, (str, os.PathLike)):
            raise SpecError([Problem.at(mark, "extends", "extends takes a path to a spec file or a zoo name")])
        found, display = locate_file(parent)  # a path from the working folder, else a zoo name
        base = _resolve(found, display, _fields_of(model_cls), _kind_of(model_cls))
        doc = _merge_documents(base, doc)
    apply_overrides(doc, overrides)
    return validate_document(doc, model_cls, "<mapping>")


def _load(path: str | Path, model_cls: type, overrides, default_name: bool, sources=None, kind: str | None = None):
    found, display = locate_file(path)
    try:
        doc = _resolve(found, display, _fields_of(model_cls), _kind_of(model_cls))
        wrong = _mistaken(doc, kind, found, display)
    except SpecError:
        try:  # refused whole, perhaps because it is plainly another kind of file: say which
            wrong = _mistaken(_resolve(found, display), kind, found, display)
        except SpecError:
            wrong = None
        if wrong is None:
            raise
    if wrong:
        raise SpecError([Problem(display, None, None, "", wrong)])
    doc.data.pop("extends", None)  # resolved: the merged document holds every field
    apply_overrides(doc, overrides, sources)
    if default_name and "name" not in doc.data:
        doc.data["name"] = found.stem
    return validate_document(doc, model_cls, display)


def _mistaken(doc: Document, kind: str | None, found: Path, display: str) -> str | None:
    """One line when ``doc`` is plainly another kind of document than ``kind`` (``yamlformer.builder.kinds``)."""
    if kind is None:
        return None
    # local: the document kinds (entry points) are read only for a file that fails to load
    from yamlformer.builder.kinds import mistaken

    if mistaken(doc.data, kind, display) is None:  # the usual case: no need to look the file up in the zoo
        return None
    return mistaken(doc.data, kind, name_of(found) or display)


# -- extends -----------------------------------------------------------------------------------


#: files in one ``extends:`` chain (real chains have two or three)
MAX_EXTENDS = 64


def _resolve(path: Path, display: str, fields=None, what: str = "a spec") -> Document:
    """Read ``path`` and, through its ``extends:``, every parent; merged, parents first.

    A loop (``os.path.realpath`` follows symbolic links) and a chain longer than
    :data:`MAX_EXTENDS` are problems located at the ``extends:`` that closes or overflows it."""
    chain: list[tuple[str, str, Document]] = []  # (real path, shown path, document), child first
    raw = read_bounded(path, display)
    while True:
        try:
            doc = parse_document(raw, display, fields, what)
        except SpecError as exc:
            raise SpecError([p for _, _, d in chain for p in d.problems] + exc.problems) from None
        chain.append((os.path.realpath(path), display, doc))
        parent = doc.data.get("extends")
        if parent is None:
            break
        where = doc.value_mark(("extends",))

        def fail(message: str) -> SpecError:
            problems = [p for _, _, d in chain for p in d.problems]
            return SpecError(problems + [Problem.at(where, "extends", message)])  # noqa: B023 (called in this pass)

        if not isinstance(parent, str) or not parent.strip():
            raise fail("extends takes a path to a file or a zoo name")
        if len(chain) >= MAX_EXTENDS:
            raise fail(f"an extends chain of more than {MAX_EXTENDS} files")
        parent_path = path.parent / parent
        parent_display = os.path.normpath(os.path.join(os.path.dirname(display), parent))
        if not os.path.lexists(parent_path):  # no file there: a zoo name (`extends: llama3-8b`)?
            # local: a zoo name is looked up only when no file is there
            from yamlformer.builder.zoo import find, not_found, shown

            entry = find(parent)
            if entry is None:
                raise fail(f"cannot read {parent_display}: {not_found(parent)}")
            parent_path, parent_display = entry.path, shown(entry.path)
        if os.path.realpath(parent_path) in [real for real, _, _ in chain]:
            raise fail("extends cycle: " + " -> ".join([shown for _, shown, _ in chain] + [parent_display]))
        try:
            raw = read_bounded(parent_path, parent_display)
        except SpecError as exc:
            raise fail(f"cannot read {parent_display}: {exc.problems[-1].message}") from None
        path, display = parent_path, parent_display
    merged = chain[-1][2]
    for _, _, doc in reversed(chain[:-1]):
        merged = _merge_documents(merged, doc)
    return merged


def _kind_of(model_cls: type | None) -> str:
    """How messages name a file of ``model_cls``: "a spec", "a recipe"..."""

    if model_cls is None or issubclass(model_cls, ModelSpec):
        return "a spec"
    return getattr(model_cls, "file_kind", "a config")


def _merge_documents(base: Document, top: Document) -> Document:
    merged = Document(None, {}, {}, base.problems + top.problems)
    merged.data = merge(base.data, top.data, types=DEFAULT_TYPES, out=merged, base_from=(base, ()), top_from=(top, ()))
    merged.values[()] = top.values[()]
    return merged


# -- overrides ---------------------------------------------------------------------------------


def _apply_override(doc: Document, key: str, value: Any, source: Source | None = None) -> None:
    """Set ``a.b.0.c`` to ``value``, creating missing sections; located at ``source`` (where it
    was written) or as ``<--set a.b=v>``."""
    if source is None:
        mark = Mark(f"<--set {key}={_show(value)}>")
        source = (Document(value, {}, {}), ())
        _mark_all(value, (), mark, source[0])
    else:
        mark = source[0].key_mark(source[1]) or Mark(f"<{key}>")
    parts = key.split(".")
    node, path = doc.data, ()
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            try:
                index = int(part)
                node[index]
            except (ValueError, IndexError):
                where = ".".join(parts[:i]) or "the spec"
                raise SpecError(
                    [Problem.at(mark, key, f"{where} is a list of {len(node)}; {part!r} is not an index in it")]
                ) from None
            step: str | int = index % len(node)
        elif isinstance(node, dict):
            step = part
            if not last and node.get(part) is None:
                if parts[i + 1].lstrip("-").isdigit():
                    where = ".".join(parts[: i + 1])
                    raise SpecError([Problem.at(mark, key, f"{where} is not set, so it has no entry {parts[i + 1]}")])
                node[part] = {}
                doc.keys[path + (part,)] = doc.values[path + (part,)] = mark
        else:
            where = ".".join(parts[:i])
            raise SpecError([Problem.at(mark, key, f"{where} is a value ({node!r}), not a section with fields")])
        if last:
            here = path + (step,)
            base = node[step] if isinstance(node, list) or step in node else None
            node[step] = merge(
                base, value, types=DEFAULT_TYPES, out=doc, at=here, base_from=(doc, here), top_from=source
            )
            doc.keys[here] = mark
        else:
            node, path = node[step], path + (step,)


def _mark_all(value: Any, path: FieldPath, mark: Mark, doc: Document) -> None:
    doc.keys[path] = doc.values[path] = mark
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        _mark_all(child, path + (key,), mark, doc)


def _show(value: Any, limit: int = 60) -> str:
    """A --set value as its location shows it, cut to ``limit`` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
