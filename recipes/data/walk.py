"""Walking the folders a corpus is read from: every source walk goes through :func:`walk`.

Symbolic links are followed (a corpus is often a folder of links to where the data lives), and
each real file and folder is visited once, whatever the links: a link back up the tree
(``loop/self -> ../loop``) or two links to one file read it once, not once per path (a folder
with one file and a link to itself was read 41 times, until the path grew too long). What is one
file is decided by the file system (device and inode, as ``os.stat`` follows the links), so a
hard link is one file too. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from yamlformer.recipes.errors import RecipeError


class Seen:
    """The real files and folders met so far; share one over several walks (several sources of
    one corpus) to read a file they have in common once."""

    def __init__(self) -> None:
        self._ids: set[tuple[int, int]] = set()

    @staticmethod
    def _key(path: Path) -> tuple[int, int] | None:
        try:
            stat = os.stat(path)
        except (OSError, ValueError):
            return None
        return stat.st_dev, stat.st_ino

    def known(self, path: Path) -> bool:
        """Whether ``path``'s real file or folder was met already (it is not marked met)."""
        return self._key(path) in self._ids

    def first(self, path: Path) -> bool:
        """Whether ``path``'s real file or folder is met for the first time (a broken link or a
        path that cannot be read: False, it is not read)."""
        key = self._key(path)
        if key is None or key in self._ids:
            return False
        self._ids.add(key)
        return True


def walk(
    folder: Path,
    seen: Seen | None = None,
    hidden: bool = True,
    skip: Callable[[Path], bool] = lambda _: False,
    whole: Callable[[Path], bool] = lambda _: False,
) -> Iterator[Path]:
    """The regular files under ``folder``, depth first, each folder's entries in name order (the
    order of ``sorted(folder.rglob("*"))``), links followed, each real file and folder once
    (``seen``: what earlier walks met). ``hidden``: also names starting with a dot; ``skip(dir)``:
    a folder left out; ``whole(dir)``: a folder yielded as one entry, not entered (a dataset
    folder read as a unit)."""
    seen = seen if seen is not None else Seen()
    if not seen.first(folder):
        return
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise RecipeError(f"{folder}: a folder that cannot be read ({exc.strerror or type(exc).__name__})") from None
    for entry in entries:
        if not hidden and entry.name.startswith("."):
            continue
        if entry.is_dir():
            if skip(entry):
                continue
            if whole(entry):
                if seen.first(entry):
                    yield entry
            else:
                yield from walk(entry, seen, hidden, skip, whole)
        elif entry.is_file() and seen.first(entry):
            yield entry
