"""Reading YAML as plain data that remembers where every key and value was written.

:class:`SpecLoader` is a ``yaml.SafeLoader`` that builds the document itself from the composed
node tree: only the YAML core tags are accepted (mappings, sequences, strings, numbers,
booleans, null), so ``!!python/object`` and friends are refused before anything is constructed.
Every mapping key and value gets a :class:`Mark` (file, 1-based line and column) under its
field path, duplicate keys are reported (PyYAML silently keeps the last one), and anchors,
aliases and merge keys (``<<: *base``) work.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Union

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

FieldPath = tuple[Union[str, int], ...]

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + name for name in ("str", "int", "float", "bool", "null")}
_MAP_TAG, _SEQ_TAG, _MERGE_TAG = _CORE + "map", _CORE + "seq", _CORE + "merge"
#: more nodes than any spec has; stops alias bombs ("billion laughs") from exhausting memory
_MAX_NODES = 200_000


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where something was written: a file and a 1-based line and column (``None`` off-file)."""

    file: str
    line: int | None = None
    col: int | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, located: ``file:line:col: field.path: message``."""

    file: str
    line: int | None
    col: int | None
    path: str
    message: str

    @classmethod
    def at(cls, mark: Mark, path: FieldPath | str, message: str) -> Problem:
        dotted = path if isinstance(path, str) else ".".join(map(str, path))
        return cls(mark.file, mark.line, mark.col, dotted, message)

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.col}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ValueError):
    """A spec (or config) that cannot be loaded; ``problems`` lists every located problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


@dataclasses.dataclass
class Document:
    """Plain data plus, for each field path, where its key and its value were written.

    A merge (``builder.merge``) that copies a value from another path records it: ``origins``
    maps a path to the path the value was written at, ``bases`` a merged mapping to the mapping
    it was laid over (a key missing from the result is missing there too).
    """

    data: Any
    keys: dict[FieldPath, Mark]
    values: dict[FieldPath, Mark]
    problems: list[Problem] = dataclasses.field(default_factory=list)  # non-fatal (duplicates)
    origins: dict[FieldPath, FieldPath] = dataclasses.field(default_factory=dict)
    bases: dict[FieldPath, FieldPath] = dataclasses.field(default_factory=dict)

    def key_mark(self, path: FieldPath) -> Mark | None:
        return self.keys.get(path) or self.values.get(path)

    def value_mark(self, path: FieldPath) -> Mark | None:
        return self.values.get(path) or self.keys.get(path)

    def written_at(self, path: FieldPath, missing: bool = False) -> FieldPath:
        """The path the user wrote what is at ``path`` (after merges); ``missing``: where a key
        absent from a merged mapping is absent first (the mapping it was laid over)."""
        if missing:
            while path[:-1] in self.bases:
                path = self.bases[path[:-1]] + path[-1:]
        for n in range(len(path), 0, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]] + path[n:]
        return path


class SpecLoader(yaml.SafeLoader):
    """Safe YAML with locations. Use :meth:`read` (or :func:`read_document`)."""

    def read(self, file: str) -> Document:
        self.file = file
        self.doc = Document(None, {}, {})
        self.nodes = 0
        try:
            root = self.get_single_node()
        except yaml.MarkedYAMLError as exc:
            raise SpecError([_syntax_problem(file, exc)]) from None
        except yaml.YAMLError as exc:  # the reader: a character YAML does not allow
            raise SpecError([Problem(file, None, None, "", f"not readable as YAML: {exc}")]) from None
        finally:
            self.dispose()
        if root is None:
            raise SpecError([Problem(file, 1, 1, "", "the file is empty; a spec is a mapping of fields")])
        if not isinstance(root, MappingNode):
            mark = self._mark(root)
            raise SpecError([Problem.at(mark, "", f"a spec is a mapping of fields, not {_kind(root)}")])
        self.doc.values[()] = self._mark(root)
        self.doc.data = self._build(root, (), set())
        return self.doc

    # -- building ---------------------------------------------------------------------------

    def _mark(self, node: Node) -> Mark:
        return Mark(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def _fail(self, node: Node, path: FieldPath, message: str):
        raise SpecError([*self.doc.problems, Problem.at(self._mark(node), path, message)])

    def _build(self, node: Node, path: FieldPath, active: set[int]) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            self._fail(node, path, f"more than {_MAX_NODES} YAML nodes (aliases expanding without end?)")
        if id(node) in active:
            self._fail(node, path, "an alias refers to a node that contains it (a recursive structure)")
        if isinstance(node, ScalarNode):
            if node.tag not in _SCALAR_TAGS:
                self._fail(node, path, f"tag {node.tag!r} is not allowed: a spec holds plain data only")
            return self.construct_object(node, deep=True)
        active = active | {id(node)}
        if isinstance(node, SequenceNode):
            if node.tag != _SEQ_TAG:
                self._fail(node, path, f"tag {node.tag!r} is not allowed: a spec holds plain data only")
            items = []
            for index, child in enumerate(node.value):
                self.doc.keys[path + (index,)] = self.doc.values[path + (index,)] = self._mark(child)
                items.append(self._build(child, path + (index,), active))
            return items
        if node.tag != _MAP_TAG:
            self._fail(node, path, f"tag {node.tag!r} is not allowed: a spec holds plain data only")
        return self._build_mapping(node, path, active)

    def _build_mapping(self, node: MappingNode, path: FieldPath, active: set[int]) -> dict:
        result: dict[str, Any] = {}
        merges = [value for key, value in node.value if key.tag == _MERGE_TAG]
        # Merge sources first, the last one first, so earlier sources and then the mapping's
        # own keys win (YAML merge-key semantics), and the winners' marks are the ones kept.
        for source in reversed(merges):
            sources = source.value if isinstance(source, SequenceNode) else [source]
            for mapping in reversed(sources):
                if not isinstance(mapping, MappingNode):
                    self._fail(mapping, path, "a merge key (<<) takes a mapping or a list of mappings")
                result.update(self._build(mapping, path, active))
        seen: dict[str, Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            if not isinstance(key_node, ScalarNode):
                self._fail(key_node, path, "a key must be a plain name, not a mapping or list")
            if key_node.tag not in _SCALAR_TAGS:
                self._fail(key_node, path, f"tag {key_node.tag!r} is not allowed on a key: a spec holds plain data only")
            key = str(key_node.value)
            if key in seen:
                first = self._mark(seen[key])
                self.doc.problems.append(
                    Problem.at(
                        self._mark(key_node),
                        path + (key,),
                        f"duplicate key {key!r} (first set on line {first.line}); remove one",
                    )
                )
            seen[key] = key_node
            self.doc.keys[path + (key,)] = self._mark(key_node)
            self.doc.values[path + (key,)] = self._mark(value_node)
            result[key] = self._build(value_node, path + (key,), active)
        return result


# The YAML 1.2 core schema, which editors' language servers and most other readers use, instead
# of PyYAML's YAML 1.1 one: only true/false are booleans (`yes`, `on` and `n` stay strings), `1:8`
# is the string a layer slice needs (YAML 1.1 reads it as the base-60 integer 68), `010` is ten,
# floats such as 1e-5 are floats, and dates stay strings. Strict fields then refuse what is not
# of their type instead of guessing.
SpecLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    (
        "float",
        r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        "-+.0123456789",
    ),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("merge", r"<<", "<"),
):
    SpecLoader.add_implicit_resolver(_CORE + _tag, re.compile(rf"^(?:{_pattern})$"), list(_first))


def _construct_int(loader: SpecLoader, node: ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


SpecLoader.add_constructor(_CORE + "int", _construct_int)


def read_document(path: str | Path, display: str | None = None) -> Document:
    """Read one YAML file into a located :class:`Document` (raises :class:`SpecError`)."""
    file = display or str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError([Problem(file, None, None, "", f"cannot read the file: {exc.strerror or exc}")]) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise SpecError([Problem(file, line, col, "", "not UTF-8 text")]) from None
    try:
        loader = SpecLoader(text)
    except yaml.YAMLError as exc:  # the reader checks characters up front
        raise SpecError([_reader_problem(file, text, exc)]) from None
    try:
        return loader.read(file)
    except yaml.reader.ReaderError as exc:
        raise SpecError([_reader_problem(file, text, exc)]) from None


def parse_value(text: str) -> Any:
    """A ``--set`` value: a YAML scalar or flow value (``2``, ``1::2``, ``null``, ``[0, 2]``)."""
    loader = SpecLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is None:
        return None
    loader.file, loader.doc, loader.nodes = "<--set>", Document(None, {}, {}), 0
    return loader._build(root, (), set())


def _syntax_problem(file: str, exc: yaml.MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    message = " ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
    if mark is None:
        return Problem(file, None, None, "", f"YAML syntax error: {message}")
    return Problem(file, mark.line + 1, mark.column + 1, "", f"YAML syntax error: {message}")


def _reader_problem(file: str, text: str, exc: yaml.YAMLError) -> Problem:
    position = getattr(exc, "position", 0) or 0
    line = text.count("\n", 0, position) + 1
    col = position - text.rfind("\n", 0, position)
    return Problem(file, line, col, "", f"character YAML does not allow: {getattr(exc, 'reason', exc)}")


def _kind(node: Node) -> str:
    if isinstance(node, SequenceNode):
        return "a list"
    if isinstance(node, ScalarNode):
        return f"a single value ({node.value!r})" if node.value else "a single empty value"
    return "this"
