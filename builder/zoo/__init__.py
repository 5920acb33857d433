"""The zoo: the specs and recipes shipped with the package, found by name. Torch-free.

A zoo name is a spec's path under the spec folder without ``.yaml`` (``llama3-8b``,
``tiny/llama``) or a recipe's file stem (``lm-stdlib``); ``.yaml`` may be added. Every command
that takes a spec or recipe file takes a name too, and so do ``extends:`` and a recipe's
``model.spec``. **A path that exists wins over a name**: ``llama3-8b`` is the zoo's unless a
file ``llama3-8b`` is there (relative to the working directory on the command line, to the
file that writes it in ``extends:`` and ``model.spec``). ``builder list`` shows the zoo;
``builder cp NAME FILE`` copies an entry to edit.

Where the files are: a wheel carries the repository's ``specs/`` as ``builder/zoo/specs``
(``setup.py`` copies it at build time); a checkout or an editable install reads ``specs/`` at
the repository root. Each kind of document names its folder (``yamlformer.builder.kinds``): the spec's
is :func:`spec_folder`, the recipes' the ``recipes`` package's own ``*.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path

from yamlformer.builder.paths import exists

#: the file endings of zoo entries
SUFFIXES = (".yaml", ".yml")


class ZooError(ValueError):
    """A file that is neither there nor a zoo name; the message is one line with the closest names."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One shipped file: its zoo name, its kind (``spec``, ``recipe``) and where it is."""

    name: str
    kind: str
    path: Path


def spec_folder() -> Path | None:
    """The shipped specs: ``builder/zoo/specs`` in a wheel, else the checkout's ``specs/``."""
    here = Path(__file__).resolve().parent
    for folder in (here / "specs", here.parents[1] / "specs"):
        if folder.is_dir():
            return folder
    return None


def entries() -> dict[str, Entry]:
    """Every zoo entry by name, kinds in :func:`yamlformer.builder.kinds.kinds` order (a name taken by
    an earlier kind stays with it)."""
    # local: the kinds come from entry points (importlib.metadata, ~80 ms), read for a zoo lookup only
    from yamlformer.builder.kinds import kinds

    found: dict[str, Entry] = {}
    for kind in kinds().values():
        folder = kind.folder()
        if folder is None:
            continue
        files = folder.rglob("*") if kind.recursive else folder.glob("*")
        for path in sorted(files):
            if path.suffix in SUFFIXES and path.is_file():
                name = path.relative_to(folder).with_suffix("").as_posix()
                found.setdefault(name, Entry(name, kind.name, path))
    return found


def find(name: str) -> Entry | None:
    """The entry called ``name`` (``.yaml`` may be added), or ``None``."""
    text = name.strip().replace(os.sep, "/")
    for suffix in SUFFIXES:
        text = text.removesuffix(suffix)
    return entries().get(text)


def name_of(path: str | Path) -> str | None:
    """The zoo name of a file inside the zoo, or ``None``."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return None
    for entry in entries().values():
        if entry.path.resolve() == resolved:
            return entry.name
    return None


def did_you_mean(name: str, kind: str | None = None) -> str:
    """``; did you mean 'llama3-8b'?`` for the closest zoo names (``""`` when none is close)."""
    names = [e.name for e in entries().values() if kind is None or e.kind == kind]
    text = name.strip()
    for suffix in SUFFIXES:
        text = text.removesuffix(suffix)
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    close += [n for n in names if n.rsplit("/", 1)[-1] == text.rsplit("/", 1)[-1] and n not in close]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def locate(text: str | Path, base: str | Path | None = None) -> Path:
    """The file ``text`` names: a path (relative to ``base``, default the working directory)
    when one exists there, else the zoo entry of that name. Raises :class:`ZooError`."""
    raw = str(text)
    path = Path(raw).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if exists(path) or not raw.strip():  # a link that is there is refused as what it is (a loop)
        return path
    entry = find(raw)
    if entry is not None:
        return entry.path
    raise ZooError(not_found(raw, path))


def not_found(text: str, tried: Path | None = None) -> str:
    """``no such file`` (``tried``: the path looked for, named when it is not ``text`` as given)
    and, for what could be a zoo name, the closest names."""
    file = "no such file" + (f" {tried}" if tried is not None and str(tried) != text else "")
    if not entries():
        # local: asked only when the zoo is empty (a checkout never installed)
        from yamlformer.builder.packages import NOT_INSTALLED, installed

        if not installed():  # no entry points, so no kinds and no zoo
            return f"{file}, and no zoo: {NOT_INSTALLED}"
    close = did_you_mean(text)
    if close:
        return f"{file}, nor a zoo name{close} (`builder list` shows the zoo)"
    if Path(text).is_absolute() or text.endswith(SUFFIXES):
        return file
    return f"{file}, nor a zoo name (`builder list` shows the zoo)"


def shown(path: str | Path) -> str:
    """A path as messages show it: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, RuntimeError):  # outside it, or no resolving (a loop of links)
        return str(path)
