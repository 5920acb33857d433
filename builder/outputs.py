"""What a command that writes a model may write over (torch-free).

A command that writes model files (``import-hf``, ``export-hf``, ``consolidate``) claims its
output before it writes anything:

* never over what it reads: an output that is the input folder, or a file it would write that is
  (or links to) one of its input files, is refused even with ``--overwrite``, since the write
  would destroy the source it is reading;
* never over an earlier output without being asked: files of the kinds it writes already there
  (another model's ``model.safetensors``, ``config.json``, ``spec.yaml``...) are refused unless
  ``--overwrite``; files of other kinds are left alone and never reported as written.

:class:`Snapshot` records the files a command may write before it runs, so that afterwards it
can say which it wrote (made or replaced), not every file the folder happens to hold.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from yamlformer.builder.paths import error_problem, mode_problem


class OutputError(ValueError):
    """An output a command refuses to write (one line: the option, the path and why)."""


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a file's content changed: its inode, size and modification time (None: absent)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass
class Snapshot:
    """The files of ``folder`` matching ``patterns`` (names or globs, one folder level) as they
    were when taken; :meth:`written` names those made or changed since."""

    folder: Path
    patterns: tuple[str, ...]
    before: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)

    @classmethod
    def of(cls, folder: str | Path, patterns: Iterable[str]) -> Snapshot:
        snapshot = cls(Path(folder), tuple(patterns))
        snapshot.before = {path.name: _identity(path) for path in snapshot.present()}
        return snapshot

    def present(self) -> list[Path]:
        """The files (or links) in the folder now that match the patterns, by name."""
        if not self.folder.is_dir():
            return []
        return sorted(
            (p for p in self.folder.iterdir() if any(fnmatch.fnmatchcase(p.name, pat) for pat in self.patterns)),
            key=lambda p: p.name,
        )

    def written(self) -> list[str]:
        """Names of the matching files made or replaced since the snapshot was taken."""
        return [p.name for p in self.present() if p.name not in self.before or self.before[p.name] != _identity(p)]


def claim_folder(
    out: str | Path,
    writes: Iterable[str],
    inputs: Iterable[str | Path] = (),
    overwrite: bool = False,
    option: str = "-o",
) -> Snapshot:
    """Check that a command may write the files ``writes`` (names or globs) into ``out``, reading
    ``inputs`` (files or folders); :class:`OutputError` when it may not (see the module
    docstring). Returns the :class:`Snapshot` of ``out`` taken before anything is written."""
    out = Path(out)
    snapshot = Snapshot.of(out, writes)
    target = _real(out)
    sources = [(Path(p), _real(Path(p))) for p in inputs]
    for given, real in sources:
        if real is not None and real.is_dir() and target == real:
            raise OutputError(
                f"{option} {shown(out)}: is the folder this command reads ({shown(given)}); writing there would "
                "replace the model it reads (--overwrite does not allow that): give another folder"
            )
    existing = snapshot.present()
    for path in existing:
        real = _real(path)
        for given, source in sources:
            if real is not None and source is not None and (real == source or _inside(real, source)):
                raise OutputError(
                    f"{option} {shown(out)}: would write over {path.name}, which this command reads "
                    f"({shown(given)}); --overwrite does not allow that: give another folder"
                )
    if existing and not overwrite:
        raise OutputError(
            f"{option} {shown(out)}: already holds {_names([p.name for p in existing])} (a model written "
            "before); add --overwrite to replace them, or give a new folder"
        )
    return snapshot


def claim_file(out: str | Path, inputs: Iterable[str | Path] = (), overwrite: bool = False, option: str = "-o") -> None:
    """:func:`claim_folder` for a command that writes one file, ``out``: renamed over, so only an
    absent path or a regular file is taken (a device node, FIFO, socket, folder or loop of links
    is refused, ``overwrite`` or not)."""
    out = Path(out)
    target = _real(out)
    for given in inputs:
        source = _real(Path(given))
        if target is not None and source is not None and (target == source or _inside(target, source)):
            raise OutputError(
                f"{option} {shown(out)}: is {'inside ' if target != source else ''}what this command reads "
                f"({shown(given)}); --overwrite does not allow that: give another file"
            )
    why = _not_a_file(out)
    if why is not None:  # renamed over, a device node, FIFO, socket or folder would be replaced
        raise OutputError(f"{option} {shown(out)}: {why}")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise OutputError(f"{option} {shown(out)}: exists; add --overwrite to replace it, or give a new file")


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is no file to write (``None``: absent, a link to nothing, or a regular file),
    in :mod:`yamlformer.builder.paths`' words, as the clause the refusal ends with."""
    try:
        problem = mode_problem(os.stat(path).st_mode)
    except FileNotFoundError:
        return None  # nothing there, or a link to nothing: the rename replaces the link
    except OSError as exc:  # a loop of links, a file where a folder is named: nothing can be written
        return f"cannot write it: {error_problem(exc, path)}"
    except (ValueError, TypeError):  # a NUL byte in the name
        return "cannot write it: not a valid file name"
    if problem is None:
        return None
    return f"{problem}; only a regular file is written over (--overwrite or not): give a file"


def _real(path: Path) -> Path | None:
    """The path with every link resolved (None: it cannot be resolved, a link loop)."""
    try:
        return Path(os.path.realpath(path, strict=False))
    except (OSError, RuntimeError, ValueError):
        return None


def _inside(path: Path, folder: Path) -> bool:
    return folder.is_dir() and path != folder and path.is_relative_to(folder)


def _names(names: list[str]) -> str:
    if len(names) <= 3:
        return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return f"{', '.join(names[:3])} and {len(names) - 3} more"


def shown(path) -> str:
    """A path as one line: quoted when it holds a line break or another control character."""
    text = os.fspath(path)
    return repr(text) if any(not ch.isprintable() for ch in text) else text
