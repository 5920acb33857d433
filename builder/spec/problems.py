"""Pydantic errors and spec rule errors, turned into located problems a user can act on.

Pydantic reports a location as a path through the *models* (``decoder.attention.multi_head.
n_heads``: the tagged union adds the block's type name); a user thinks in the YAML's keys.
:func:`validation_problems` walks each error's location through the model types and the data
together, drops the union tags, finds the line that set the field, and rewords the message
("unknown key 'n_kv_head'; did you mean 'n_kv_heads'?"). A block's own rule names its field
(``yamlformer.blocks.configs.base.rule_error``); a field a merge copied from elsewhere (a layer override
inheriting the stack's block) is reported where it was written, as the merge recorded.
"""

from __future__ import annotations

import difflib
import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from yamlformer.blocks.configs.base import rule_error  # noqa: F401  (recipes raise it too)
from yamlformer.builder.spec.schema import SpecRuleError
from yamlformer.builder.spec.source import Document, FieldPath, Mark, Problem


def validation_problems(model_cls: type, data: Any, doc: Document) -> tuple[Any, list[Problem]]:
    """Validate ``data`` as ``model_cls``: ``(instance, [])`` or ``(None, located problems)``."""

    try:
        return model_cls.model_validate(data, context={"document": doc}), []
    except ValidationError as exc:
        problems = _pydantic_problems(model_cls, data, doc, exc.errors())
    except SpecRuleError as exc:
        problems = [_locate(doc, data, tuple(loc), message, "value") for loc, message in exc.problems]
    return None, _dedupe(problems)


def _pydantic_problems(model_cls: type, data: Any, doc: Document, errors: list[dict]) -> list[Problem]:
    problems: list[Problem] = []
    by_union: dict[FieldPath, list[tuple[dict, str, FieldPath]]] = {}
    for error in errors:
        path, models, label, label_at = _walk(model_cls, error["loc"], data)
        if label is not None:  # a plain union (`str | list[int]`): one message per field, below
            by_union.setdefault(path[:label_at], []).append((error, label, path))
            continue
        problems.append(_problem(doc, data, path, models, error))
    for field, branches in by_union.items():
        value = _get(data, field)
        matching = [(e, path) for e, label, path in branches if _label_matches(label, value)]
        if matching:
            problems += [_problem(doc, data, path, [], e) for e, path in matching]
        else:
            words = (_LABEL_WORDS.get(label.split("[")[0], label) for _, label, _ in branches)
            wanted = " or ".join(dict.fromkeys(words))
            problems.append(_locate(doc, data, field, f"expected {wanted}, got {_show(value)}", "value"))
    return problems


def _problem(doc: Document, data: Any, path: FieldPath, models: list[type], error: dict) -> Problem:
    kind, _value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        key = path[-1]
        names = [name for model in models for name in model.model_fields]
        message = f"unknown key {key!r}" + (_did_you_mean(str(key), names) or _belongs_under(str(key), models, path))
        return _locate(doc, data, path, message, "key")
    if kind == "missing":
        return _locate(doc, data, path, f"missing required field {path[-1]!r}", "missing")
    if kind in ("unknown_block_type", "union_tag_invalid", "union_tag_not_found"):
        return _block_type_problem(doc, data, path, error)
    if kind == "located_rule":  # a config's own rule: it names the field (yamlformer.blocks.configs.base)
        ctx = error["ctx"]
        return _locate(doc, data, path + tuple(ctx["loc"]), ctx["message"], "value")
    return _locate(doc, data, path, _reword(error), "value")


def _block_type_problem(doc: Document, data: Any, path: FieldPath, error: dict) -> Problem:
    ctx, value = error.get("ctx") or {}, error.get("input")
    if "expected_tags" in ctx:
        options = re.findall(r"'([^']*)'", ctx["expected_tags"])
    else:
        options = [o.strip() for o in error["msg"].split(":", 1)[-1].split(",")]
    listed = ", ".join(options)
    if isinstance(value, dict) and "type" in value:
        given = value["type"]
        message = f"unknown type {given!r}" + _did_you_mean(str(given), options) + f" (one of: {listed})"
        return _locate(doc, data, path + ("type",), message, "value")
    if isinstance(value, dict):
        return _locate(doc, data, path, f"needs a `type:` (one of: {listed})", "missing_key")
    message = f"expected a mapping with a `type:` (one of: {listed}), got {_show(value)}"
    return _locate(doc, data, path, message, "value")


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "str": "a string",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping of fields",
    "model_attributes": "a mapping of fields",
}
_LABEL_WORDS = {
    "dict": "a mapping",
    "str": "a string",
    "constrained-str": "a string",
    "list": "a list",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
}
#: other tools' names for a choice, and ours (Hugging Face's activations, PyTorch's module names)
ALIASES = {
    "swish": "silu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "layer_norm": "layernorm",
    "rms_norm": "rmsnorm",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _reword(error: dict) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = ""
        if isinstance(value, str):
            alias = ALIASES.get(value.strip().lower())
            hint = f"; {value!r} is called {alias!r} here" if alias in options else _did_you_mean(value, options)
        return f"{_show(value)} is not one of: {', '.join(options)}{hint}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound}, got {_show(value)}"
    if kind == "string_too_long":
        return f"at most {ctx['max_length']:,} characters, got {len(value):,}"
    if kind == "too_long":
        return f"at most {ctx['max_length']:,} items, got {ctx.get('actual_length', len(value)):,}"
    if kind == "value_error":
        return str(ctx.get("error") or error["msg"].removeprefix("Value error, "))
    for prefix, words in _TYPE_WORDS.items():
        if kind.startswith(prefix + "_") or kind == prefix:
            extra = ""
            if kind == "int_from_float":
                extra = " (a whole number)"
            return f"expected {words}{extra}, got {_show(value)}"
    return f"{error['msg']} (got {_show(value)})"


def _models_in(annotation: Any, depth: int = 0) -> list[type]:
    """The pydantic models a field's annotation holds (through unions, ``Annotated``, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if depth > 4:
        return []
    return [m for arg in get_args(annotation) for m in _models_in(arg, depth + 1)]


def _belongs_under(key: str, models: list[type], path: FieldPath) -> str:
    """``; it belongs under 'attention' (decoder.attention.sliding_window)`` for a key that is not
    a field here but is one of a field's own mapping (a key indented one level too shallow)."""
    homes = list(
        dict.fromkeys(
            name
            for model in models
            for name, info in model.model_fields.items()
            if any(key in sub.model_fields for sub in _models_in(info.annotation))
        )
    )
    if not homes:
        return ""
    where = ".".join(str(p) for p in path[:-1])
    shown = " or ".join(f"{where + '.' if where else ''}{home}.{key}" for home in homes)
    return f"; it belongs under {' or '.join(repr(h) for h in homes)} ({shown})"


def _did_you_mean(given: str, options: list[str]) -> str:
    close = difflib.get_close_matches(given, list(dict.fromkeys(options)), n=1, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


# -- pydantic locations to YAML paths ----------------------------------------------------------


def _walk(model_cls: type, loc: tuple, data: Any) -> tuple[FieldPath, list[type], str | None, int]:
    """YAML path of a pydantic loc, the models at its parent, and a plain-union label if any."""
    kinds: list[Any] = [model_cls]
    parents: list[type] = []
    node, path, tagged, label, label_at = data, (), False, None, 0
    for part in loc:
        members = [m for t in kinds for m in _members(t)]
        models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if not tagged and isinstance(part, str) and _is_tag(part, models, node):
            kinds, tagged = [m for m in models if _tag(m) == part], True
            continue
        tagged = False
        if isinstance(part, str) and label is None and not isinstance(node, dict) and not models:
            label, label_at = part, len(path)  # `str | list[int]`: pydantic names the branch
            kinds = [m for m in members if _label_of(m) == part] or members
            continue
        branch = _branch(part, members) if isinstance(part, str) and label is None and len(members) > 1 else []
        if branch:  # `list[Any] | Distribution` given a mapping: pydantic names the branch, a model's as "dict"
            label, label_at = ("dict" if issubclass(branch[0], BaseModel) else part), len(path)
            kinds = branch
            continue
        parents = models
        nxt: list[Any] = []
        for m in members:
            if isinstance(part, int) and get_origin(m) is list:
                nxt.append(get_args(m)[0])
            elif isinstance(part, str) and get_origin(m) is dict and len(get_args(m)) == 2:
                nxt.append(get_args(m)[1])  # a mapping's value, whatever its key
            elif m in models and part in m.model_fields:
                nxt.append(m.model_fields[part].annotation)
        kinds = nxt
        path += (part,)
        node = (
            node.get(part)
            if isinstance(node, dict)
            else (
                node[part]
                if isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node)
                else None
            )
        )
    return path, parents, label, label_at


def _branch(part: str, members: list[Any]) -> list[Any]:
    """The members of a plain union a pydantic loc part names (``list[any]``, ``Distribution``,
    ``function-after[_ordered(), Distribution]`` for a model with an after-validator); [] when
    the part is a field name."""
    if any(isinstance(m, type) and issubclass(m, BaseModel) and part in m.model_fields for m in members):
        return []
    name = part
    while match := re.fullmatch(r"function-\w+\[[^,]*, (.*)\]", name):  # validators wrap the model's name
        name = match.group(1)
    found = []
    for m in members:
        if isinstance(m, type) and issubclass(m, BaseModel):
            if name == m.__name__:
                found.append(m)
        elif part.lower() == _label_of(m).lower():
            found.append(m)
    return found


def _is_tag(part: str, models: list[type], node: Any) -> bool:
    """Whether a loc part names a tagged union's branch (``multi_head``) rather than a YAML key."""
    if not any(_tag(m) == part for m in models):
        return False
    # a key of that name is a key, unless the mapping's own `type` names that branch
    return not (isinstance(node, dict) and part in node and node.get("type") != part)


def _members(tp: Any) -> list[Any]:
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for arg in get_args(tp) for m in _members(arg)]
    return [tp]


def _tag(model: type) -> Any:
    field = model.model_fields.get("type")
    return field.default if field is not None else None


def _label_of(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    return f"{origin.__name__}[{', '.join(_label_of(a) for a in get_args(tp))}]"


_LABEL_TYPES = {
    "str": str,
    "constrained-str": str,
    "list": list,
    "int": int,
    "float": (int, float),
    "bool": bool,
    "dict": dict,
}


def _label_matches(label: str, value: Any) -> bool:
    wanted = _LABEL_TYPES.get(label.split("[")[0])
    return wanted is not None and isinstance(value, wanted)


# -- locating ----------------------------------------------------------------------------------


def _get(data: Any, path: FieldPath) -> Any:
    node = data
    for part in path:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and -len(node) <= part < len(node)
        ):
            node = node[part]
        else:
            return _MISSING
    return node


_MISSING = object()


def locate(doc: Document, path: FieldPath, message: str) -> Problem:
    """A problem with the value of field ``path`` of ``doc``'s data, at the line that set it (a rule
    checked after validation, such as whether a spec splits for tensor parallelism)."""
    return _locate(doc, doc.data, tuple(path), message, "value")


def _locate(doc: Document, data: Any, path: FieldPath, message: str, how: str) -> Problem:
    """``how``: key (an unknown key), value (a bad value), missing (a field not given)."""
    path = doc.written_at(path, missing=how == "missing")
    if how == "missing":
        parent = path[:-1]
        mark = doc.key_mark(parent) if parent else doc.values.get(())
        return Problem.at(mark or _nearest(doc, parent), path, message)
    if how == "missing_key":
        mark = doc.key_mark(path) if path else doc.values.get(())
        return Problem.at(mark or _nearest(doc, path), path, message)
    mark = doc.key_mark(path) if how == "key" else doc.value_mark(path)
    return Problem.at(mark or _nearest(doc, path), path, message)


def _nearest(doc: Document, path: FieldPath) -> Mark:
    """A field left to its default has no line: point at the closest ancestor that has one."""
    for n in range(len(path) - 1, 0, -1):
        mark = doc.key_mark(path[:n])
        if mark is not None:
            return mark
    return doc.values.get(()) or Mark("<spec>")


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, unique = set(), []
    for problem in problems:
        key = (problem.file, problem.line, problem.path, problem.message)
        if key not in seen:
            seen.add(key)
            unique.append(problem)
    return unique
