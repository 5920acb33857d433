"""Writing checkpoints so that a failed or interrupted save never costs the previous one.

A file checkpoint (:func:`write_checkpoint`) is sealed with the checksums of its tensors
(:mod:`yamlformer.builder.checkpoints.integrity`), written to a temp file beside its name, flushed to disk,
then renamed over it. A sharded one (:func:`save_sharded`, run by every rank of
``yamlformer.recipes.parallel.ShardedStrategy``) is written by ``torch.distributed.checkpoint`` into a temp
folder ``.NAME.tmp-ID``, each rank with the checksums of its own shard files
(:func:`write_digests`); once all are done rank 0 seals ``meta.pt`` (:func:`write_meta`) and
renames the folder into place. Either way :func:`swap_into` keeps the checkpoint there as
``last-1.ckpt`` when it is ``last.ckpt`` of an earlier step, so a resume has an intact checkpoint
to fall back on, or as ``.NAME.old-ID`` until the new one is in place; whatever moment a process
dies at, a whole checkpoint is left, and :func:`tidy` renames it back and removes dead saves'
temp folders before anything reads or writes ``NAME`` again.

A save that fails (a full disk, a file-size limit, a read-only folder; for a sharded one on any
rank: ``torch.distributed.checkpoint`` gathers every rank's outcome) removes its temp file or
folder, leaves the previous checkpoint as it was and raises one line naming the checkpoint
(:class:`~yamlformer.builder.checkpoints.format.CheckpointWriteError`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path

from yamlformer.builder.checkpoints.format import META_FILE, SHARD_FILES, CheckpointWriteError, exists, previous_path
from yamlformer.builder.checkpoints.integrity import file_digests, seal
from yamlformer.builder.checkpoints.read import peek_meta

#: a rank's checksums of the shard files it wrote, beside them until rank 0 seals ``meta.pt``
DIGESTS = ".digests-{rank}.json"

#: why a write failed, by the OS error's number
_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EFBIG: "file too large (the file-size limit, `ulimit -f`)",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such folder",
    errno.EISDIR: "it is a folder",
    errno.EEXIST: "a file is where its folder should be",
    errno.ENOTDIR: "a file is in its path",
}
if hasattr(errno, "EDQUOT"):
    _REASONS[errno.EDQUOT] = "disk quota exceeded"


def write_reason(exc: BaseException) -> str:
    """Why a write failed, in words (safetensors reports the OS error inside its own message)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and (found := re.search(r"(?:code: |os error )(\d+)", str(exc))):
        code = int(found.group(1))
    if code in _REASONS:
        return _REASONS[code]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return os.strerror(code) if code else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def user_mode(path) -> None:
    """Give a file the mode the user's umask makes for new files (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_error(path: Path, reason: str) -> CheckpointWriteError:
    kept = f"the previous {path.name} is kept" if path.exists() else "no checkpoint was written"
    return CheckpointWriteError(f"could not write {path}: {reason}; {kept}")


class _ErrorKeepingFile:
    """A binary file for ``torch.save`` that remembers the OS error of a failed write (the zip
    writer reports it only as a position mismatch)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()


def write_checkpoint(checkpoint: dict, path: str | Path) -> Path:
    """Seal ``checkpoint`` and write it to ``path`` atomically (see the module docstring)."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    path = Path(path)
    seal(checkpoint)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            writer = _ErrorKeepingFile(f)
            torch.save(checkpoint, writer)
            f.flush()
            os.fsync(f.fileno())
        swap_into(tmp, path, checkpoint.get("global_step"))  # a predecessor of an earlier step kept (file or folder)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise _write_error(path, write_reason(exc)) from None
        if isinstance(exc, RuntimeError) and writer is not None and writer.error is not None:
            raise _write_error(path, write_reason(writer.error)) from None
        raise
    return path


def _step_of(path: Path) -> int | None:
    """The step of the checkpoint at ``path`` (peeked at: tensors stay on disk), or None when
    there is none or it cannot be read (a damaged one is never kept as a predecessor)."""
    try:
        return int(peek_meta(path).get("global_step"))
    except Exception:
        return None


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (the renames) to disk, where the platform allows it."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap_into(tmp: Path, path: Path, step: int | None) -> None:
    """Rename the finished ``tmp`` to ``path``: the checkpoint there is kept as its predecessor
    (``last-1.ckpt``) when it is of an earlier step, else removed once the new one is in place."""
    tmp, path = Path(tmp), Path(path)
    previous = previous_path(path)
    old = None
    if exists(path) or path.exists():
        old_step = _step_of(path)
        if previous is not None and old_step is not None and old_step != step:
            _remove(previous)
            os.replace(path, previous)  # an intact predecessor from an earlier step is kept
        else:
            old = path.with_name(f".{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            os.replace(path, old)
    os.replace(tmp, path)
    _sync_folder(path.parent)  # the renames reach the disk before the old copy goes
    if old is not None:
        _remove(old)


def _debris(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"), key=lambda p: p.stat().st_mtime)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def tidy(path: str | Path) -> None:
    """Put back a checkpoint a save died between its two renames, and remove the temp and old
    folders earlier saves left beside ``path`` (one writer at a time: rank 0)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    olds = _debris(path, "old")
    if olds and not exists(path):
        os.replace(olds.pop(), path)
    for leftover in olds + _debris(path, "tmp"):
        _remove(leftover)


# -- sharded folders -------------------------------------------------------------------------------


def save_sharded(checkpoint: dict, path: Path, tmp: Path, rank: int, ranks: int, barrier) -> None:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict`` and ``optimizer_states`` hold this
    rank's shards) to the folder ``path`` through ``tmp`` (the same on every rank). Every rank
    calls it; ``barrier()`` waits for all of them."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path, tmp = Path(path), Path(tmp)
    if rank == 0:
        tidy(path)
    barrier()
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    try:
        dcp.save(state, checkpoint_id=tmp)  # raises on every rank when any rank failed
        write_digests(tmp, rank)
    except (Exception, CheckpointException) as exc:
        if rank == 0:
            _remove(tmp)
        raise _sharded_write_error(path, exc) from None
    barrier()
    if rank == 0:
        try:
            write_meta(checkpoint, tmp, ranks)
            swap_into(tmp, path, checkpoint.get("global_step"))
        except OSError as exc:
            _remove(tmp)
            raise _sharded_write_error(path, exc) from None
    barrier()


def _sharded_write_error(path: Path, exc: BaseException) -> CheckpointWriteError:
    """One line for a sharded save that failed: the checkpoint, why (the first OS error of any
    rank, or that another process of the run stopped), and that the previous one is kept."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch.distributed as dist

    failures = [f[0] for f in getattr(exc, "failures", {}).values()] or [exc]
    errors = [f for f in failures if isinstance(f, OSError)]
    text = re.sub(r"\[[^\]]*\]\s*", "", (str(failures[0]).strip().splitlines() or [""])[0])[:200]  # no source paths
    if errors:
        reason = write_reason(errors[0])
    elif isinstance(failures[0], dist.DistError) or re.search(
        r"gloo|nccl|connection|timed out", str(failures[0]), re.I
    ):
        reason = f"another process of the run stopped or cannot be reached ({text or type(failures[0]).__name__})"
    else:
        reason = text or type(failures[0]).__name__
    return _write_error(path, reason)


def write_digests(folder: Path, rank: int) -> None:
    """This rank's shard files in ``folder`` and their CRC-32, for rank 0 to seal."""
    folder = Path(folder)
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + ([".metadata"] if rank == 0 else [])
    (folder / DIGESTS.format(rank=rank)).write_text(json.dumps(file_digests(folder, names)))


def write_meta(checkpoint: dict, folder: Path, ranks: int) -> None:
    """``folder/meta.pt``: the checkpoint's non-tensor part, sealed with its own checksums and
    every rank's shard-file checksums (gathered from their digest files, then removed), flushed."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    folder = Path(folder)
    files: dict[str, int] = {}
    for rank in range(ranks):
        digest = folder / DIGESTS.format(rank=rank)
        files.update(json.loads(digest.read_text()))
    checkpoint[SHARD_FILES] = files  # sealed with the rest: a damaged record is a damaged meta.pt
    seal(checkpoint)
    with open(folder / META_FILE, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    for rank in range(ranks):
        (folder / DIGESTS.format(rank=rank)).unlink()
