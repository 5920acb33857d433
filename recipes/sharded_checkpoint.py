"""Writing a sharded checkpoint so that no moment of a crash costs the previous one.

Every rank writes its shards (``torch.distributed.checkpoint``) into a temp folder
``.NAME.tmp-ID`` beside ``NAME`` and the checksums of its own shard files
(:func:`write_digests`); once all are done, rank 0 seals ``meta.pt`` (the step, loops and
``builder`` metadata, and every rank's file checksums: :func:`write_meta`) and renames the temp
folder into place (:func:`swap_into`): the checkpoint there becomes ``last-1.ckpt`` when it is
``last.ckpt`` of an earlier step (as ``recipes.checkpoint.write_checkpoint`` keeps a file's
predecessor), or ``.NAME.old-ID`` until the new one is in place. Whatever moment a process dies
at, a whole checkpoint is left: ``NAME``, ``last-1.ckpt``, or (between the two renames)
``.NAME.old-ID``, which :func:`tidy` renames back before anything reads or writes ``NAME`` again;
temp folders of saves that died are removed by the next save. :func:`save` is the whole
sequence, run by every rank (``recipes.parallel.ShardedStrategy.save_checkpoint``).

A save that fails on any rank (a full disk, a read-only folder: ``torch.distributed.checkpoint``
gathers every rank's outcome, so all of them know) removes its temp folder, keeps the previous
checkpoint and stops the run with one line naming the checkpoint
(:class:`~recipes.checkpoint.CheckpointWriteError`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from recipes.checkpoint import _step_of, _sync_folder, previous_path

#: a rank's checksums of the shard files it wrote, beside them until rank 0 seals ``meta.pt``
DIGESTS = ".digests-{rank}.json"


def save(checkpoint: dict, path: Path, tmp: Path, rank: int, ranks: int, barrier) -> None:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict`` and ``optimizer_states`` hold this
    rank's shards) to the folder ``path`` through ``tmp`` (the same on every rank). Every rank
    calls it; ``barrier()`` waits for all of them."""
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
        raise _write_error(path, exc) from None
    barrier()
    if rank == 0:
        try:
            write_meta(checkpoint, tmp, ranks)
            swap_into(tmp, path, checkpoint.get("global_step"))
        except OSError as exc:
            _remove(tmp)
            raise _write_error(path, exc) from None
    barrier()


def load_file(module, optimizers, path: Path, strict: bool = True) -> dict:
    """A file checkpoint (written by one process or DDP) into this rank's shards of ``module``
    (the LightningModule, sharded) and ``optimizers``; returns the rest of the checkpoint (step,
    loops, ``builder``). Read safely (``weights_only``; rank 0 verified it when it chose it).
    The optimizer states are keyed by position in their parameter groups; they are given to
    ``set_optimizer_state_dict`` by name, in the groups' order (Lightning's own conversion
    numbers ``module.parameters()`` instead, which is not the groups' order: weight-decay and
    no-decay groups)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from builder.checkpoints import STATE_KEY, read_meta

    checkpoint = dict(read_meta(path, check=False))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop(STATE_KEY), options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        groups = get_optimizer_state_dict(module, optimizer)["param_groups"]  # the names, in the groups' order
        names = [name for group in groups for name in group["params"]]
        by_name = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [
                dict(group, params=[names[i] for i in group["params"]]) for group in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(module, optimizer, optim_state_dict=by_name, options=options)
    return checkpoint


def _write_error(path: Path, exc: BaseException):
    """One line for a save that failed: the checkpoint, why (the first OS error of any rank, or
    that another process of the run stopped), and that the previous checkpoint is kept."""
    import re

    import torch.distributed as dist

    from recipes.checkpoint import CheckpointWriteError
    from recipes.training.run_folder import os_reason

    failures = [f[0] for f in getattr(exc, "failures", {}).values()] or [exc]
    errors = [f for f in failures if isinstance(f, OSError)]
    text = re.sub(r"\[[^\]]*\]\s*", "", (str(failures[0]).strip().splitlines() or [""])[0])[:200]  # no source paths
    if errors:
        reason = os_reason(errors[0])
    elif isinstance(failures[0], dist.DistError) or re.search(
        r"gloo|nccl|connection|timed out", str(failures[0]), re.I
    ):
        reason = f"another process of the run stopped or cannot be reached ({text or type(failures[0]).__name__})"
    else:
        reason = text or type(failures[0]).__name__
    kept = f"the previous {path.name} is kept" if path.exists() else "no checkpoint was written"
    return CheckpointWriteError(f"could not write {path}: {reason}; {kept}")


def _debris(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"), key=lambda p: p.stat().st_mtime)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def tidy(path: Path) -> None:
    """Put back a checkpoint a save died between its two renames, and remove the temp and old
    folders earlier saves left beside ``path`` (one writer at a time: rank 0)."""
    from builder.checkpoints import exists

    path = Path(path)
    if not path.parent.is_dir():
        return
    olds = _debris(path, "old")
    if olds and not exists(path):
        os.replace(olds.pop(), path)
    for leftover in olds + _debris(path, "tmp"):
        _remove(leftover)


def write_digests(folder: Path, rank: int) -> None:
    """This rank's shard files in ``folder`` and their CRC-32, for rank 0 to seal."""
    from builder.integrity import file_digests

    folder = Path(folder)
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + ([".metadata"] if rank == 0 else [])
    (folder / DIGESTS.format(rank=rank)).write_text(json.dumps(file_digests(folder, names)))


def write_meta(checkpoint: dict, folder: Path, ranks: int) -> None:
    """``folder/meta.pt``: the checkpoint's non-tensor part, sealed with its own checksums and
    every rank's shard-file checksums (gathered from their digest files, then removed), flushed."""
    import torch

    from builder.checkpoints import META_FILE, SHARD_FILES
    from builder.integrity import seal

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


def swap_into(tmp: Path, path: Path, step: int | None) -> None:
    """Rename the finished ``tmp`` to ``path``: the checkpoint there is kept as its predecessor
    (``last-1.ckpt``) when it is of an earlier step, else removed once the new one is in place."""
    from builder.checkpoints import META_FILE, exists

    tmp, path = Path(tmp), Path(path)
    previous = previous_path(path)
    old = None
    if exists(path) or path.exists():
        old_step = _step_of(path / META_FILE if path.is_dir() else path)
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
