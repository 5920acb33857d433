"""What a path a user gives is, said once: the verdict every reader of a spec, a recipe or a
recipe's data gives before it opens anything. Torch-free; the standard library only.

A regular file that can be read passes (and, where a folder is taken, a folder that can be
listed); anything else is one short reason: missing, a link to nothing, a loop of symbolic
links, a folder where a file is read, a FIFO, a device or a socket (which would block or never
end), or unreadable. ``builder validate`` and the run ask the same function, so they agree.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

#: what a path is when it is no regular file, by ``stat`` test
_KINDS = (
    (stat.S_ISFIFO, "is a FIFO (named pipe)"),
    (stat.S_ISCHR, "is a character device"),
    (stat.S_ISBLK, "is a block device"),
    (stat.S_ISSOCK, "is a socket"),
)
#: why a path cannot be opened, by ``errno``
_ERRORS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ELOOP: "a loop of symbolic links",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
}


def _wanted(folder: bool) -> str:
    return "a file or folder" if folder else "a file"


def mode_problem(mode: int, folder: bool = False) -> str | None:
    """Why a path of ``stat`` mode ``mode`` is not what is read (``None``: it is); ``folder``: a
    folder is taken too."""
    if stat.S_ISREG(mode) or (folder and stat.S_ISDIR(mode)):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kind = next((what for test, what in _KINDS if test(mode)), "is no regular file")
    return f"{kind}, not {_wanted(folder)}"


def error_problem(exc: OSError, path: str | Path, folder: bool = False) -> str:
    """Why opening ``path`` failed with ``exc``, in words (a dangling link said as one)."""
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return "a symbolic link to nothing (its target does not exist)"
        return "no such file or folder" if folder else "no such file"
    if exc.errno == errno.EISDIR and not folder:
        return "is a folder, not a file"
    return _ERRORS.get(exc.errno, f"cannot open it: {exc.strerror or type(exc).__name__}")


def path_problem(path: str | Path, folder: bool = False) -> str | None:
    """Why ``path`` cannot be read (``None``: it can): a readable regular file, or with ``folder``
    a folder that can be listed too. Links are followed; nothing is opened."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return error_problem(exc, path, folder)
    except (ValueError, TypeError):  # a NUL byte in the name
        return "not a valid file name"
    why = mode_problem(info.st_mode, folder)
    if why is not None:
        return why
    access = os.R_OK | (os.X_OK if stat.S_ISDIR(info.st_mode) else 0)
    if not os.access(path, access, effective_ids=os.access in os.supports_effective_ids):  # as open() is
        return "permission denied"
    return None


def exists(path: str | Path) -> bool:
    """Whether anything is at ``path``, a link included (a loop of links or a link to nothing is
    there, to be refused as what it is, not taken for a missing file)."""
    try:
        return os.path.lexists(path)
    except (ValueError, TypeError):
        return False
