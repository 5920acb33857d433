"""Every way a checkpoint is read, side by side, and each checked against its checksums.

* :func:`read_checkpoint`: one file, loaded safely (``weights_only``, memory-mapped: a tensor's
  bytes are read when touched), each way a file can be broken one line naming it, and verified.
* :func:`peek_meta`: the one cheap read, named so: a file's or a folder's step, loops and
  ``builder`` record with no checksum checked and no tensor read, for choosing among a run's
  checkpoints by step and for comparing a recipe with its checkpoint before any work.
* :func:`read_meta`: the same, verified (a sharded folder's shard files too).
* :func:`read_weights`: the model's whole tensors of a file or a sharded folder (resharded from
  whatever layout wrote them); :func:`load_model`: the trained model on the CPU.
* :func:`read_whole`: a sharded folder as the one dict a file holds (a run saved under
  ``trainer.strategy: fsdp`` resumed in one process or under DDP).
* :func:`newest_intact`: the checkpoint of a run folder a resume starts from;
  :func:`read_for_resume`: the checkpoint Lightning restores the run from;
  :func:`load_into_shards`: a file checkpoint into a sharded model's ranks.

A file is read once while it is unchanged: its load and its check are remembered (by path,
device, inode, size and times), so the several readers of one run (a resume's choice, its recipe
comparison and Lightning's load; the questions a run asks of ``model.init_from``) read it one
time. :func:`forget` drops a file (the resume load does once Lightning has its copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.checkpoints.format import (
    BUILDER_KEY,
    META_FILE,
    RESUMABLE,
    SHARD_FILES,
    STATE_KEY,
    CheckpointError,
    DamagedCheckpointError,
    empty_model,
    is_sharded,
    lightning_names,
    load_weights,
    model_weights,
    not_ours,
)
from yamlformer.builder.checkpoints.integrity import verify, verify_files
from yamlformer.builder.packages import renamed_global

#: files remembered at once (their tensors are mapped, not held in memory)
_KEPT = 8


@dataclasses.dataclass
class _Read:
    """A file read once: what it held, whether it was verified, and (``meta.pt`` of a sharded
    folder) the signatures of the shard files when they were checked."""

    signature: tuple
    checkpoint: dict
    verified: bool = False
    shard_files: tuple | None = None


_READS: OrderedDict[str, _Read] = OrderedDict()


def _signature(path: Path) -> tuple | None:
    """What changes when a file is written again or replaced (None: no such file)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _recall(path: Path) -> _Read | None:
    read = _READS.get(os.path.abspath(path))
    if read is None or read.signature != _signature(path):
        return None
    _READS.move_to_end(os.path.abspath(path))
    return read


def forget(path: str | Path) -> None:
    """Drop what was remembered of the checkpoint at ``path`` (a file, or a folder's ``meta.pt``)."""
    for file in (Path(path), Path(path) / META_FILE):
        _READS.pop(os.path.abspath(file), None)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnicodeError):  # a member name that is not text: the zip directory changed
        return "its table of contents is garbled (a byte changed on disk or in transfer)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "central directory" in text or "zip archive" in text or isinstance(exc, EOFError):
        return "it is cut short (truncated) or is not a checkpoint file"
    if "invalid load key" in text or isinstance(exc, pickle.UnpicklingError):
        return "its contents are not a checkpoint (overwritten or garbage)"
    return text[:200]


def _torch_load(path: Path, zipped: bool):
    """``torch.load(weights_only=True)``; a checkpoint of a QLoRA run holds torchao's NF4 weights,
    which torch's safe loader takes once torchao is imported (it registers them): imported then."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    def load():
        with warnings.catch_warnings():  # torch warns about a pickle protocol it did not write
            warnings.simplefilter("ignore")
            # a pickle (torch's legacy format, or pickle.dump) is read as safely as a zip archive
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)

    try:
        return load()
    except pickle.UnpicklingError as exc:
        if "torchao." not in str(exc):
            raise
        # local: the checkpoint readers load without torch until they read; NF4 needs the blocks' quantizer
        from yamlformer.blocks.linear import nf4_quantizer

        try:
            nf4_quantizer()
        except ImportError:
            raise exc from None
        return load()


def _load(path: Path) -> dict:
    """``torch.load(weights_only=True)`` of one file, memory-mapped, its faults one line each."""

    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise DamagedCheckpointError(f"{path} is damaged: it is empty (0 bytes)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        zipped = zipfile.is_zipfile(path)  # torch.save writes a zip archive; its directory is at the end
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not zipped and not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(EOFError())}")
    try:
        checkpoint = _torch_load(path, zipped)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc) or "global" in str(exc):  # torch names the global it refused
            raise CheckpointError(
                f"{path} is not a checkpoint this tool can load safely: "
                + (renamed_global(str(exc)) or "it holds Python objects besides tensors and plain values")
            ) from None
        if not zipped:
            raise CheckpointError(
                f"{path} is not a checkpoint this tool can load safely: it is a Python pickle that "
                "torch.save did not write"
            ) from None
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RuntimeError as exc:
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    except (EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{path} is not a `builder train` checkpoint (it holds no mapping)")
    return dict(checkpoint)


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint file loaded with ``torch.load(weights_only=True)`` (memory-mapped: tensors are
    read as they are touched) and verified against its record; loaded and verified once while
    the file is unchanged.

    Raises :class:`CheckpointError` for a missing file, a folder, or a file that holds Python
    objects a weights-only load refuses; :class:`DamagedCheckpointError` for an empty, truncated
    or garbled file or a checksum that does not match. Each is one line naming ``path``.
    """
    return _read_file(Path(path), check=True)


def _read_file(path: Path, check: bool) -> dict:
    """:func:`read_checkpoint`, verified only with ``check`` (the peek does not)."""
    read = _recall(path)
    if read is None:
        signature = _signature(path)  # taken before the load: a file written meanwhile is read again
        read = _Read(signature, _load(path))
        _READS[os.path.abspath(path)] = read
        while len(_READS) > _KEPT:
            _READS.popitem(last=False)
    if check and not read.verified:
        try:
            verify(read.checkpoint, path)
        except DamagedCheckpointError:
            raise
        except Exception as exc:
            raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
        read.verified = True
    return dict(read.checkpoint)


def _meta_file(path: Path) -> Path:
    """The file that holds a checkpoint's non-tensor values: itself, or a folder's ``meta.pt``."""
    if path.is_dir() and not is_sharded(path):
        raise CheckpointError(
            f"{path} is a folder but not a checkpoint written by `builder train` (no .metadata and {META_FILE})"
        )
    if path.is_dir() and not (path / META_FILE).is_file():
        raise DamagedCheckpointError(f"{path} is damaged: {META_FILE} is missing")
    return path / META_FILE if path.is_dir() else path


def _ours(path: Path, checkpoint: dict) -> dict:
    if not isinstance(checkpoint.get(BUILDER_KEY), Mapping):
        raise CheckpointError(not_ours(path, checkpoint))
    return checkpoint


def peek_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's values (``builder``, ``global_step``, loops ...) with nothing verified and no
    tensor read: the one cheap read, for a step to choose by or a recipe to compare with before a
    run does any work. Whatever is used further is read through :func:`read_meta`, which checks
    what this read (at no second load). One line of :class:`CheckpointError` naming ``path`` for a
    missing, unsafe, unreadable or foreign checkpoint."""
    path = Path(path)
    return _ours(path, _read_file(_meta_file(path), check=False))


def read_meta(path: str | Path, check: bool = True, files: bool = True) -> dict[str, Any]:
    """The checkpoint (``builder``, ``global_step``, loops ...; a file's tensors memory-mapped),
    verified against its checksums (a sharded folder's shard files too, unless ``files`` is False:
    all ranks but the one that checks them). ``check=False`` is :func:`peek_meta`. Raises
    :class:`CheckpointError` (one line naming the path) for a missing, unsafe, damaged or foreign
    checkpoint."""
    if not check:
        return peek_meta(path)
    path = Path(path)
    meta = _meta_file(path)
    checkpoint = _ours(path, read_checkpoint(meta))
    if files and path.is_dir():
        digests = checkpoint.get(SHARD_FILES)
        if not isinstance(digests, Mapping) or not digests:
            raise DamagedCheckpointError(f"{path} is damaged: {META_FILE} records no shard checksums")
        read = _recall(meta)
        seen = tuple(_signature(path / name) for name in sorted(digests))
        if read is None or read.shard_files != seen:
            verify_files(path, digests)
            if read is not None:
                read.shard_files = seen
    return checkpoint


@contextlib.contextmanager
def _reading_shards(path: Path):
    """``torch.distributed.checkpoint`` reading a folder in this process alone, its failure one
    line naming the folder."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            yield
    except (Exception, CheckpointException) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise CheckpointError(f"cannot read the shards of {path}: {lines[-1][:200]}") from None


def read_weights(path: str | Path, template: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The LightningModule's whole tensors (``model.`` names) of a file or sharded checkpoint,
    verified. A sharded checkpoint is read into ``template`` (the names and shapes to fill, e.g. a
    CPU model's ``state_dict`` with ``model.`` names: filled in place) or, without one, into fresh
    CPU tensors of the model its own metadata describes."""
    path = Path(path)
    checkpoint = read_meta(path)
    if not is_sharded(path):
        if not isinstance(checkpoint.get(STATE_KEY), Mapping):
            raise CheckpointError(f"{path} holds no weights")
        return dict(checkpoint[STATE_KEY])
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch.distributed.checkpoint as dcp

    if template is None:
        template = lightning_names(empty_model(checkpoint[BUILDER_KEY]["spec"], path).state_dict())
    state = {STATE_KEY: dict(template)}
    with _reading_shards(path):
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state[STATE_KEY]


def read_whole(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as the one dict a file checkpoint holds, verified: ``meta.pt``'s
    values, the whole weights under ``state_dict`` and each optimizer's state under
    ``optimizer_states`` keyed by parameter position (``torch.distributed.checkpoint`` keeps them
    by name), so a run saved under ``trainer.strategy: fsdp`` resumes in one process or under DDP.
    Every tensor is read whole into this process."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    checkpoint = read_meta(path)
    state: dict[str, Any] = {}
    with _reading_shards(path):  # as DCP's own format_utils.dcp_to_torch_save reads a folder whole
        _load_state_dict(
            state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    checkpoint[STATE_KEY] = state.pop(STATE_KEY)
    count = sum(1 for key in state if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [_by_position(state[f"optimizer_{i}"]) for i in range(count)]
    return checkpoint


def _by_position(optimizer: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``) keyed by
    position in its parameter groups instead (``torch.optim.Optimizer.state_dict``)."""
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in optimizer["state"].items()},
        "param_groups": [
            dict(group, params=[position[n] for n in group["params"]]) for group in optimizer["param_groups"]
        ],
    }


def load_model(path: str | Path):
    """``(model, meta)``: the trained model on the CPU in eval mode and the checkpoint's
    ``builder`` metadata (``global_step`` added), from a verified file or sharded checkpoint."""
    checkpoint = read_meta(path)
    builder = dict(checkpoint[BUILDER_KEY], global_step=checkpoint.get("global_step"))
    model = empty_model(builder["spec"], path)
    if is_sharded(path):  # the shards are read in place into the model's own tensors
        read_weights(path, lightning_names(model.state_dict()))
    else:
        load_weights(model, model_weights(checkpoint[STATE_KEY]), path)
    return model.eval(), builder


# -- a run's checkpoints ---------------------------------------------------------------------------


def newest_intact(
    folder: str | Path, files: bool = True
) -> tuple[Path | None, dict | None, list[tuple[Path, Exception]]]:
    """``(path, checkpoint, damaged)``: the intact checkpoint of :data:`RESUMABLE` in ``folder``
    with the highest step (each one's step peeked at; then verified, newest first, until one
    passes: ``files`` as :func:`read_meta` takes it) and the ``(path, error)`` of each damaged
    one met on the way."""
    listed, damaged = [], []
    for order, name in enumerate(RESUMABLE):
        path = Path(folder) / name
        if not (path.is_file() or is_sharded(path)):
            continue
        try:
            step = int(peek_meta(path).get("global_step") or 0)
        except (CheckpointError, TypeError, ValueError) as exc:
            damaged.append((path, exc))
            continue
        listed.append((step, -order, path))
    for _, _, path in sorted(listed, reverse=True):
        try:
            return path, read_meta(path, files=files), damaged
        except CheckpointError as exc:
            damaged.append((path, exc))
    return None, None, damaged


def _in_memory(tree: Any) -> Any:
    """``tree`` with every tensor copied into memory (off the file it maps)."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return {key: _in_memory(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_in_memory(value) for value in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_in_memory(value) for value in tree)
    return tree


def read_for_resume(path: str | Path) -> dict[str, Any]:
    """The checkpoint Lightning restores a run from, as it holds it: a file from the read that
    verified it when the resume chose it (not read again; verified now if it was not), every
    tensor but the weights (which the load copies into the model) copied into memory, so the
    run's optimizer state maps no file a later save removes; a sharded folder read whole
    (:func:`read_whole`). The file is forgotten after."""
    path = Path(path)
    try:
        if is_sharded(path):
            return read_whole(path)
        checkpoint = read_checkpoint(path)
        return {key: value if key == STATE_KEY else _in_memory(value) for key, value in checkpoint.items()}
    finally:
        forget(path)


def load_into_shards(module, optimizers, path: str | Path, strict: bool = True, whole_groups=None) -> dict:
    """A file checkpoint (written by one process or DDP) into this rank's shards of ``module``
    (the LightningModule, sharded) and ``optimizers``; returns the rest of the checkpoint (step,
    loops, ``builder``). Verified (at no cost when the resume's choice verified it). The optimizer
    states are keyed by position in their parameter groups; they are given to
    ``set_optimizer_state_dict`` by name, in the groups' order (Lightning's own conversion numbers
    ``module.parameters()`` instead, which is not the groups' order: weight-decay and no-decay
    groups). ``whole_groups(groups)``: where this rank holds only some of the model's parameters
    (a pipeline stage), the named groups of the whole model that the positions count in. Every
    rank reads the file, so a stage takes its own weights and optimizer state from its copy."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    try:
        checkpoint = read_meta(path)
    finally:
        forget(path)
    weights = checkpoint.pop(STATE_KEY)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    if whole_groups is not None:  # a part of the model (a pipeline stage): its own weights and their
        # optimizer state, each rank from its own copy (rank 0's broadcast carries only what rank 0 holds)
        options = dataclasses.replace(options, broadcast_from_rank0=False)
        held = module.state_dict().keys()
        weights = {key: value for key, value in weights.items() if key in held}
    set_model_state_dict(module, weights, options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        groups = get_optimizer_state_dict(module, optimizer)["param_groups"]  # the names, in the groups' order
        groups = whole_groups(groups) if whole_groups is not None else groups
        names = [name for group in groups for name in group["params"]]
        by_name = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [
                dict(group, params=[names[i] for i in group["params"]]) for group in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(module, optimizer, optim_state_dict=by_name, options=options)
    return checkpoint
