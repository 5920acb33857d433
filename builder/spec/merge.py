"""The one merge: how one YAML mapping is laid over another, with every location carried.

Used for ``extends:`` (the child over its parent), ``--set`` and a recipe's ``model.overrides``
(a mapping value over the spec's), a stack's per-layer ``overrides`` (each over the stack's own
blocks) and ``cross_attention`` (over the stack's ``attention``). The rule, from the spec format:
mappings merge key by key, scalars and lists replace, and a block mapping that names another
``type`` than the one under it replaces it (the fields of one block kind mean nothing to
another: ``ffn: {type: moe, ...}`` over a ``glu``). A block mapping without ``type`` is its
field's default block (``types``: field name -> default type).

With ``out`` (a :class:`~yamlformer.builder.spec.source.Document`), the result's marks follow whoever set
each key, and where a value or a whole mapping came from another path (a layer override's field
inherited from the stack's block) the document records it (``origins``, ``bases``), so a problem
found in the merged data is reported once, at the line the user wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from yamlformer.builder.spec.source import Document, FieldPath

#: where a value was written: the document and the path in it
Source = tuple[Document, FieldPath]


def merge(
    base: Any,
    top: Any,
    *,
    types: Mapping[str, str] | None = None,
    out: Document | None = None,
    at: FieldPath = (),
    base_from: Source | None = None,
    top_from: Source | None = None,
) -> Any:
    """``top`` laid over ``base`` (neither is changed). Without ``out`` nothing is located.

    ``at``: the result's path in ``out``; ``base_from``/``top_from``: where ``base`` and ``top``
    were written (default: ``out`` at ``at``).
    """
    base_from = base_from or (out, at)
    top_from = top_from or (out, at)
    if not _merges(base, top, (types or {}).get(str(at[-1])) if at else None):
        _carry(top, top_from, out, at)
        return top
    result = {}
    for key, value in base.items():
        if key not in top:
            _carry(value, _step(base_from, key), out, at + (key,), with_key=True)
            result[key] = value
    for key, value in top.items():
        _carry_key(_step(top_from, key), out, at + (key,))
        if key in base:
            result[key] = merge(
                base[key],
                value,
                types=types,
                out=out,
                at=at + (key,),
                base_from=_step(base_from, key),
                top_from=_step(top_from, key),
            )
        else:
            _carry(value, _step(top_from, key), out, at + (key,))
            result[key] = value
    if out is not None and base_from[0] is out and base_from[1] != at:
        out.bases[at] = base_from[1]  # a key missing here is missing there too
    return result


def _merges(base: Any, top: Any, default_type: str | None) -> bool:
    if not (isinstance(base, dict) and isinstance(top, dict)):
        return False
    return base.get("type", default_type) == top.get("type", base.get("type", default_type))


def _step(source: Source, key) -> Source:
    return source[0], source[1] + (key,)


def _carry_key(source: Source, out: Document | None, path: FieldPath) -> None:
    doc, src = source
    if out is None or doc is None:
        return
    if src in doc.keys:
        out.keys[path] = doc.keys[src]
    if src in doc.values:
        out.values[path] = doc.values[src]


def _carry(value: Any, source: Source, out: Document | None, path: FieldPath, with_key: bool = False) -> None:
    """Marks (and origins) of ``value``'s whole subtree, from where it was written to ``path``."""
    doc, src = source
    if out is None or doc is None:
        return
    if with_key and src in doc.keys:
        out.keys[path] = doc.keys[src]
    if src in doc.values:
        out.values[path] = doc.values[src]
    if doc is out and src != path:  # moved within one document: problems go where it was written
        out.origins[path] = doc.origins.get(src, src)
        if src in doc.bases:
            out.bases[path] = doc.bases[src]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        _carry(child, (doc, src + (key,)), out, path + (key,), with_key=True)
