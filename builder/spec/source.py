"""Reading YAML as plain data that remembers where every key and value was written.

:class:`SpecLoader` is a ``yaml.SafeLoader`` that builds the document itself from the composed
node tree: only the YAML core tags are accepted (mappings, sequences, strings, numbers,
booleans, null), so ``!!python/object`` and friends are refused before anything is constructed.
Every mapping key and value gets a :class:`Mark` (file, 1-based line and column) under its
field path, duplicate keys are reported (PyYAML silently keeps the last one), and anchors,
aliases and merge keys (``<<: *base``) work.

A file is untrusted input. Reading is bounded before and while parsing: only a regular file is
opened (never a FIFO or a device, which could block or never end), at most :data:`MAX_BYTES`;
nesting deeper than :data:`MAX_DEPTH` and more than :data:`MAX_NODES` nodes (aliases expanded)
stop the parse with a located problem, so no input reaches Python's recursion limit or exhausts
memory. Messages never quote the file: a problem names the file, line, column, the field path (its
keys cut to :data:`MAX_KEY_SHOWN` characters) and what is wrong; a file whose top-level keys are
none of the fields the caller expects (``fields``) is refused as a whole, naming none of its keys.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from yamlformer.builder.paths import error_problem, mode_problem

try:
    from yaml._yaml import CParser as _CParser
except ImportError:  # PyYAML without libyaml: the pure-Python parser
    _CParser = None

FieldPath = tuple[str | int, ...]

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + name for name in ("str", "int", "float", "bool", "null")}
_MAP_TAG, _SEQ_TAG, _MERGE_TAG = _CORE + "map", _CORE + "seq", _CORE + "merge"
#: bytes of one file: the largest spec or recipe shipped is under 3 KB
MAX_BYTES = 1 << 20
#: nesting of mappings and lists (a spec nests about 5 deep)
MAX_DEPTH = 64
#: nodes of one document, aliases expanded (a spec has about 100); stops alias bombs
MAX_NODES = 20_000
#: digits of an integer (Python refuses to convert more than 4,300)
MAX_DIGITS = 100
#: characters of a key shown in a message
MAX_KEY_SHOWN = 40


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
        dotted = path if isinstance(path, str) else ".".join(cut_key(part) for part in path)
        return cls(mark.file, mark.line, mark.col, dotted, message)

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.col}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


def cut_key(key: str | int) -> str:
    """A key as a message shows it: at most :data:`MAX_KEY_SHOWN` characters, on one line."""
    text = " ".join(str(key).split()) if isinstance(key, str) else str(key)
    return text if len(text) <= MAX_KEY_SHOWN else text[: MAX_KEY_SHOWN - 3] + "..."


class SpecError(ValueError):
    """A spec (or config) that cannot be loaded; ``problems`` lists every located problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


@dataclasses.dataclass
class Document:
    """Plain data plus, for each field path, where its key and its value were written.

    A merge (``yamlformer.builder.spec.merge``) that copies a value from another path records it: ``origins``
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


class _Located(Composer, SafeConstructor, Resolver):
    """Safe YAML with locations, over any event source (PyYAML's parser, or libyaml's, which is
    about ten times faster). Use :meth:`read` (or :func:`read_document`)."""

    def read(self, file: str, fields: Collection[str] | None = None, what: str = "a spec") -> Document:
        """The document; ``fields``: the top-level keys the caller knows (a mapping with none of
        them is refused whole, none of its keys named); ``what`` names the kind in messages."""
        self.file = file
        self.doc = Document(None, {}, {})
        self.nodes = self.composed = self.depth = 0
        try:
            root = self.get_single_node()
        except yaml.reader.ReaderError:
            raise  # located by the caller, which has the text
        except yaml.MarkedYAMLError as exc:
            raise SpecError([_syntax_problem(file, exc)]) from None
        except yaml.YAMLError as exc:  # the reader: a character YAML does not allow
            raise SpecError([Problem(file, None, None, "", f"not readable as YAML: {_first_line(exc)}")]) from None
        finally:
            self.dispose()
        if root is None:
            raise SpecError([Problem(file, 1, 1, "", f"the file is empty; {what} is a mapping of fields")])
        if not isinstance(root, MappingNode):
            mark = self._mark(root)
            raise SpecError([Problem.at(mark, "", f"{what} is a mapping of fields, not {_kind(root)}")])
        if (
            fields is not None
            and root.value
            and not any(isinstance(key, ScalarNode) and key.value in fields for key, _ in root.value)
        ):
            listed = ", ".join(list(fields)[:6])
            raise SpecError(
                [
                    Problem.at(
                        self._mark(root),
                        "",
                        f"not {what}: none of its {len(root.value)} top-level "
                        f"keys is a field of {what} ({listed}, ...)",
                    )
                ]
            )
        self.doc.values[()] = self._mark(root)
        self.doc.data = self._build(root, (), set(), 0)
        return self.doc

    # -- composing, bounded ------------------------------------------------------------------

    def compose_node(self, parent, index):
        """PyYAML's composer (recursive) with the depth and the node count checked as it goes."""
        self.depth += 1
        self.composed += 1
        # the field path composed so far: a mapping's value comes with its key node, a list's item with its index
        key = index.value if isinstance(index, ScalarNode) else index if isinstance(index, int) else None
        self.trail = [*getattr(self, "trail", [])[: self.depth - 1], key]
        try:
            if self.depth > MAX_DEPTH:
                self._stop(f"nested more than {MAX_DEPTH} levels deep (the limit)")
            if self.composed > MAX_NODES:
                self._stop(f"more than {MAX_NODES:,} YAML nodes")
            return Composer.compose_node(self, parent, index)
        finally:
            self.depth -= 1

    def _stop(self, message: str):
        mark = self.peek_event().start_mark
        path = tuple(part for part in self.trail if part is not None)
        raise SpecError([Problem.at(Mark(self.file, mark.line + 1, mark.column + 1), path, message)])

    # -- building ---------------------------------------------------------------------------

    def _mark(self, node: Node) -> Mark:
        return Mark(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def _fail(self, node: Node, path: FieldPath, message: str):
        raise SpecError([*self.doc.problems, Problem.at(self._mark(node), path, message)])

    def _build(self, node: Node, path: FieldPath, active: set[int], depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self._fail(node, path, f"more than {MAX_NODES:,} YAML nodes with aliases expanded (an alias bomb?)")
        if depth > MAX_DEPTH:
            self._fail(node, path, f"nested more than {MAX_DEPTH} levels deep with aliases expanded")
        if id(node) in active:
            self._fail(node, path, "an alias refers to a node that contains it (a recursive structure)")
        if isinstance(node, ScalarNode):
            if node.tag not in _SCALAR_TAGS:
                self._fail(node, path, f"{_tag(node)} is not allowed: a spec holds plain data only")
            if node.tag == _CORE + "int" and len(node.value) > MAX_DIGITS:
                self._fail(node, path, f"an integer of {len(node.value):,} digits (at most {MAX_DIGITS})")
            return self.construct_object(node, deep=True)
        active = active | {id(node)}
        if isinstance(node, SequenceNode):
            if node.tag != _SEQ_TAG:
                self._fail(node, path, f"{_tag(node)} is not allowed: a spec holds plain data only")
            items = []
            for index, child in enumerate(node.value):
                self.doc.keys[path + (index,)] = self.doc.values[path + (index,)] = self._mark(child)
                items.append(self._build(child, path + (index,), active, depth + 1))
            return items
        if node.tag != _MAP_TAG:
            self._fail(node, path, f"{_tag(node)} is not allowed: a spec holds plain data only")
        return self._build_mapping(node, path, active, depth)

    def _build_mapping(self, node: MappingNode, path: FieldPath, active: set[int], depth: int) -> dict:
        result: dict[str, Any] = {}
        merges = [value for key, value in node.value if key.tag == _MERGE_TAG]
        # Merge sources first, the last one first, so earlier sources and then the mapping's
        # own keys win (YAML merge-key semantics), and the winners' marks are the ones kept.
        for source in reversed(merges):
            sources = source.value if isinstance(source, SequenceNode) else [source]
            for mapping in reversed(sources):
                if not isinstance(mapping, MappingNode):
                    self._fail(mapping, path, "a merge key (<<) takes a mapping or a list of mappings")
                result.update(self._build(mapping, path, active, depth))
        seen: dict[str, Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            if not isinstance(key_node, ScalarNode):
                self._fail(key_node, path, "a key must be a plain name, not a mapping or list")
            if key_node.tag not in _SCALAR_TAGS:
                self._fail(key_node, path, f"{_tag(key_node)} is not allowed on a key: a spec holds plain data only")
            key = str(key_node.value)
            if key in seen:
                first = self._mark(seen[key])
                self.doc.problems.append(
                    Problem.at(
                        self._mark(key_node),
                        path + (key,),
                        f"duplicate key {cut_key(key)!r} (first set on line {first.line}); remove one",
                    )
                )
            seen[key] = key_node
            self.doc.keys[path + (key,)] = self._mark(key_node)
            self.doc.values[path + (key,)] = self._mark(value_node)
            result[key] = self._build(value_node, path + (key,), active, depth + 1)
        return result


# The YAML 1.2 core schema, which editors' language servers and most other readers use, instead
# of PyYAML's YAML 1.1 one: only true/false are booleans (`yes`, `on` and `n` stay strings), `1:8`
# is the string a layer slice needs (YAML 1.1 reads it as the base-60 integer 68), `010` is ten,
# floats such as 1e-5 are floats, and dates stay strings. Strict fields then refuse what is not
# of their type instead of guessing.
_Located.yaml_implicit_resolvers = {}
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
    _Located.add_implicit_resolver(_CORE + _tag, re.compile(rf"^(?:{_pattern})$"), list(_first))


def _construct_int(loader: SpecLoader, node: ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_Located.add_constructor(_CORE + "int", _construct_int)


class PySpecLoader(Reader, Scanner, Parser, _Located):
    """Located safe YAML on PyYAML's pure-Python reader, scanner and parser."""

    def __init__(self, stream: str):
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


if _CParser is not None:

    class CSpecLoader(_Located, _CParser):
        """Located safe YAML on libyaml's scanner and parser (events only: composing, with its
        limits, stays in :class:`_Located`, never libyaml's recursive C composer)."""

        def __init__(self, stream: str):
            _CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

        def dispose(self) -> None:
            pass

    SpecLoader = CSpecLoader
else:  # PyYAML built without libyaml
    SpecLoader = PySpecLoader


def read_document(
    path: str | Path, display: str | None = None, fields: Collection[str] | None = None, what: str = "a spec"
) -> Document:
    """Read one YAML file into a located :class:`Document` (raises :class:`SpecError`).

    ``fields``: the top-level keys a file of this kind has; one with none of them is refused
    whole (see :meth:`SpecLoader.read`). ``what`` names the kind in messages."""
    file = display or str(path)
    return parse_document(read_bounded(path, file), file, fields, what)


def parse_document(raw: bytes, file: str, fields: Collection[str] | None = None, what: str = "a spec") -> Document:
    """The located document of a file's bytes (see :func:`read_document`)."""
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
        return loader.read(file, fields, what)
    except SpecError as exc:
        tab = _tab_problem(file, text, exc.problems[0]) if len(exc.problems) == 1 else None
        if tab is None:
            raise
        raise SpecError([tab]) from None
    except yaml.reader.ReaderError as exc:
        raise SpecError([_reader_problem(file, text, exc)]) from None


def read_bounded(path: str | Path, file: str | None = None, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit``; a :class:`SpecError` naming
    ``file`` for anything else (missing, a folder, a FIFO or device, too large, unreadable).

    Opened without blocking (a FIFO with no writer would wait for ever) and checked on the open
    descriptor, then read no further than the limit (``/proc`` files report size 0)."""
    file = file or str(path)

    def fail(reason: str) -> SpecError:
        return SpecError([Problem(file, None, None, "", reason)])

    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise fail(error_problem(exc, path)) from None
    except (ValueError, TypeError):  # a NUL byte in the name
        raise fail("not a valid file name") from None
    try:
        info = os.fstat(fd)
        reason = mode_problem(info.st_mode)
        if reason is not None:
            raise fail(reason)
        if info.st_size > limit:
            raise fail(f"{_size(info.st_size)}, more than the {_size(limit)} a file of this kind may have")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise fail(f"more than the {_size(limit)} a file of this kind may have")
        return b"".join(chunks)
    except OSError as exc:
        raise fail(f"cannot read it: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{n} bytes"


def parse_value(text: str) -> Any:
    """A ``--set`` value: a YAML scalar or flow value (``2``, ``1::2``, ``null``, ``[0, 2]``)."""
    loader = SpecLoader(text)
    loader.file, loader.doc = "<--set>", Document(None, {}, {})
    loader.nodes = loader.composed = loader.depth = 0
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is None:
        return None
    return loader._build(root, (), set(), 0)


def _tab_problem(file: str, text: str, problem: Problem) -> Problem | None:
    """A syntax error at or after a line indented with a tab, said as what it is, at that line
    (PyYAML words it as a token problem, sometimes a line later)."""
    if not problem.message.startswith("YAML syntax error"):
        return None
    for number, line in enumerate(text.split("\n"), start=1):
        if problem.line is not None and number > problem.line:
            break
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent:
            return Problem(
                file, number, indent.index("\t") + 1, "", "a tab in the indentation: YAML indents with spaces only"
            )
    return None


def _syntax_problem(file: str, exc: yaml.MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    message = " ".join(_unquoted(part) for part in (exc.context, exc.problem) if part) or "invalid YAML"
    if "maximum nesting depth" in message:  # libyaml's own limit (1,000), met while scanning ahead
        return Problem(
            file,
            mark.line + 1 if mark else None,
            mark.column + 1 if mark else None,
            "",
            f"nested more than {MAX_DEPTH} levels deep",
        )
    if mark is None:
        return Problem(file, None, None, "", f"YAML syntax error: {message}")
    return Problem(file, mark.line + 1, mark.column + 1, "", f"YAML syntax error: {message}")


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def _unquoted(text: str) -> str:
    """PyYAML's message without the file's text it quotes (an alias, anchor or tag name): a
    quoted single character (``'\\t'``) and PyYAML's own token names (``'<block end>'``) stay."""

    def keep(match: re.Match) -> str:
        inner = match.group(0)[1:-1]
        short = len(inner) == 1 or re.fullmatch(r"\\(?:.|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4})", inner)
        return match.group(0) if short or (inner.startswith("<") and inner.endswith(">")) else "(not shown)"

    return _QUOTED.sub(keep, " ".join(text.split()))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return _unquoted(lines[0]) if lines else type(exc).__name__


def _reader_problem(file: str, text: str, exc: yaml.YAMLError) -> Problem:
    position = getattr(exc, "position", 0) or 0
    line = text.count("\n", 0, position) + 1
    col = position - text.rfind("\n", 0, position)
    character = getattr(exc, "character", None)
    if isinstance(character, str) and len(character) == 1:
        character = ord(character)
    code = f" (#x{character:04x})" if isinstance(character, int) else ""
    return Problem(file, line, col, "", f"character YAML does not allow{code}: {getattr(exc, 'reason', 'special')}")


def _tag(node: Node) -> str:
    """A node's tag as a message shows it, short (``!!python/name:os.system``, ``!include``)."""
    tag = node.tag or ""
    if tag.startswith(_CORE):
        tag = "!!" + tag[len(_CORE) :]
    return f"tag {cut_key(tag)!r}"


def _kind(node: Node) -> str:
    if isinstance(node, SequenceNode):
        return "a list"
    if isinstance(node, ScalarNode):
        return "a single value" if node.value else "a single empty value"
    return "this"
