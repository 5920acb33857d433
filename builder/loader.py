"""Loading specs: located YAML, ``extends:`` chains, ``--set`` overrides, located errors.

``load_spec("specs/llama/llama2-7b.yaml", overrides={"decoder.n_layers": 2})`` returns the
validated ``ModelSpec``, or raises :class:`SpecError` listing every problem in the file as
``file:line:col: field.path: message``. ``load_config`` runs the same machinery for any
pydantic model (recipes use it). Nothing here imports torch.

Order of application: the ``extends:`` chain (parent first; mappings merge key by key,
scalars and lists replace), then the overrides (each located as ``<--set key=value>``), then
validation. A block mapping whose ``type`` differs from its parent's replaces it instead of
merging. ``name`` defaults to the file's stem when the file itself does not set it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from builder.problems import validation_problems
from builder.yaml_source import Document, FieldPath, Mark, Problem, SpecError, parse_value, read_document

__all__ = [
    "Problem",
    "SpecError",
    "load_spec",
    "load_config",
    "validate_file",
    "parse_set_args",
    "read_merged",
]


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None, plugins: Iterable[str] = ()):
    """Load, merge and validate a model spec; raises :class:`SpecError` with every problem."""
    from builder.plugins import load_plugins
    from builder.schema import spec_model

    load_plugins(plugins)
    return _load(path, spec_model(), overrides, default_name=True)


def load_config(path: str | Path, model_cls: type, overrides: Mapping[str, Any] | None = None):
    """Load any YAML config into ``model_cls`` (a pydantic model) with the same located errors."""
    return _load(path, model_cls, overrides, default_name=False)


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
        except Exception as exc:  # noqa: BLE001  (yaml's own errors: report, never a traceback)
            problems.append(Problem.at(where, key, f"not a YAML value: {str(exc).splitlines()[0]}"))
    if problems:
        raise SpecError(problems)
    return overrides


def read_merged(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Document:
    """The file after its ``extends:`` chain and the overrides, not validated yet."""
    path = Path(path)
    doc = _resolve(path, str(path), [])
    if overrides:
        problems = []
        for key, value in overrides.items():
            if key.split(".")[0] == "extends":
                problems.append(
                    Problem.at(Mark(f"<--set {key}>"), key, "extends is read from the file before --set applies; "
                               "write `extends:` in the file (or a new file that extends it)")
                )
                continue
            try:
                _apply_override(doc, key, value)
            except SpecError as exc:
                problems += exc.problems
        if problems:
            raise SpecError(doc.problems + problems)
    return doc


def _load(path: str | Path, model_cls: type, overrides, default_name: bool):
    doc = read_merged(path, overrides)
    data = doc.data
    if default_name and "name" not in data:
        data["name"] = Path(path).stem
    if "extends" in data and "extends" not in model_cls.model_fields:
        del data["extends"]
    spec, problems = validation_problems(model_cls, data, doc)
    problems = doc.problems + problems
    if problems:
        top = str(path)  # this file's problems first, in line order; then its parents'; then --set
        order = lambda p: (p.line is None, p.file != top, p.file, p.line or 0, p.col or 0)  # noqa: E731
        raise SpecError(sorted(problems, key=order))
    return spec


# -- extends -----------------------------------------------------------------------------------


def _resolve(path: Path, display: str, chain: list[tuple[Path, str]]) -> Document:
    """Read ``path`` and, through its ``extends:``, every parent; merged, parents first."""
    doc = read_document(path, display)
    parent = doc.data.get("extends")
    if parent is None:
        return doc
    where = doc.value_mark(("extends",))
    if not isinstance(parent, str) or not parent.strip():
        raise SpecError(doc.problems + [Problem.at(where, "extends", "extends takes a path to a spec file")])
    parent_path = path.parent / parent
    parent_display = os.path.normpath(os.path.join(os.path.dirname(display), parent))
    here = (path.resolve(), display)
    seen = [resolved for resolved, _ in chain] + [here[0]]
    if parent_path.resolve() in seen:
        names = [shown for _, shown in chain] + [display, parent_display]
        raise SpecError(doc.problems + [Problem.at(where, "extends", "extends cycle: " + " -> ".join(names))])
    if not parent_path.is_file():
        reason = "is a directory" if parent_path.is_dir() else "no such file"
        raise SpecError(doc.problems + [Problem.at(where, "extends", f"cannot read {parent_display}: {reason}")])
    try:
        base = _resolve(parent_path, parent_display, chain + [here])
    except SpecError as exc:
        raise SpecError(doc.problems + exc.problems) from None
    return _merge_documents(base, doc)


def _merge_documents(base: Document, top: Document) -> Document:
    merged = Document(None, {}, {}, base.problems + top.problems)
    merged.values[()] = top.values[()]
    merged.data = _merge(base.data, top.data, (), base, top, merged)
    return merged


def _merge(base: Any, top: Any, path: FieldPath, bdoc: Document, tdoc: Document, out: Document) -> Any:
    """Mappings merge key by key (locations follow whoever set the key); anything else replaces.

    A block mapping that names a different ``type`` than its parent's replaces it: the fields
    of one block kind mean nothing to another (``ffn: {type: moe, ...}`` over a ``glu``).
    """
    if not (isinstance(base, dict) and isinstance(top, dict)) or base.get("type", top.get("type")) != top.get(
        "type", base.get("type")
    ):
        _copy_marks(top, path, tdoc, out)
        return top
    result = {}
    for key, value in base.items():
        if key not in top:
            _copy_marks(value, path + (key,), bdoc, out, with_key=True)
            result[key] = value
    for key, value in top.items():
        sub = path + (key,)
        out.keys[sub], out.values[sub] = tdoc.keys[sub], tdoc.values[sub]
        result[key] = _merge(base[key], value, sub, bdoc, tdoc, out) if key in base else _copied(value, sub, tdoc, out)
    return result


def _copied(value: Any, path: FieldPath, src: Document, out: Document) -> Any:
    _copy_marks(value, path, src, out)
    return value


def _copy_marks(value: Any, path: FieldPath, src: Document, out: Document, with_key: bool = False) -> None:
    if with_key and path in src.keys:
        out.keys[path] = src.keys[path]
    if path in src.values:
        out.values[path] = src.values[path]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        _copy_marks(child, path + (key,), src, out, with_key=True)


# -- overrides ---------------------------------------------------------------------------------


def _apply_override(doc: Document, key: str, value: Any) -> None:
    """Set ``a.b.0.c`` to ``value``, creating missing sections; located as ``<--set a.b=v>``."""
    mark = Mark(f"<--set {key}={_show(value)}>")
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
            node[step] = value
            _mark_all(value, path + (step,), mark, doc)
        else:
            node, path = node[step], path + (step,)


def _mark_all(value: Any, path: FieldPath, mark: Mark, doc: Document) -> None:
    doc.keys[path] = doc.values[path] = mark
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        _mark_all(child, path + (key,), mark, doc)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
