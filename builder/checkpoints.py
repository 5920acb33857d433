"""Training checkpoints as one file or as a sharded folder, read the same way.

``builder train`` writes a checkpoint either as one ``torch.save`` file (one process, DDP) or,
under ``trainer.strategy: fsdp``, as a folder written by ``torch.distributed.checkpoint`` (every
rank its own shards, in parallel): ``.metadata`` and ``__R_N.distcp`` files for the tensors, and
``meta.pt`` (Lightning's name) for everything else: the step, the loops' state, our ``builder``
metadata (spec, recipe, tokenizer), the CRC-32 of every shard file (``shard_files``) and the
integrity record (``builder.integrity``: the checksums of all of ``meta.pt``'s values). Both
are read here without a process group and verified: :func:`read_meta` loads only the small
part, :func:`read_weights` the model's whole tensors (resharded from whatever layout wrote
them), :func:`read_whole` everything, as a file checkpoint holds it (a sharded run resumed in
one process or under DDP). ``builder consolidate`` turns a folder into one ``model.safetensors``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder.integrity import CheckpointError, DamagedCheckpointError, not_ours, read_checkpoint, verify_files

__all__ = [
    "CheckpointError",
    "DamagedCheckpointError",
    "META_FILE",
    "SHARD_FILES",
    "STATE_KEY",
    "consolidate",
    "exists",
    "is_sharded",
    "load_model",
    "load_weights",
    "model_weights",
    "read_meta",
    "read_weights",
    "read_whole",
]

#: the file beside the shards that holds everything but tensors (Lightning's ``_METADATA_FILENAME``)
META_FILE = "meta.pt"
#: the key in ``meta.pt`` of every shard file's CRC-32 (sealed with ``meta.pt``'s other values)
SHARD_FILES = "shard_files"
#: the key the LightningModule's weights sit under, in a file checkpoint and in the shards alike
STATE_KEY = "state_dict"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder written by ``torch.distributed.checkpoint`` (its
    ``.metadata`` or our ``meta.pt`` there: a folder that lost one is a damaged checkpoint, which
    :func:`read_meta` names, not some other folder)."""
    path = Path(path)
    return path.is_dir() and ((path / ".metadata").is_file() or (path / META_FILE).is_file())


def exists(path: str | Path) -> bool:
    """A checkpoint is at ``path``: a file, or a sharded folder with its metadata."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / ".metadata").is_file() and (path / META_FILE).is_file())


def read_meta(path: str | Path, check: bool = True, files: bool = True) -> dict[str, Any]:
    """The checkpoint (``builder``, ``global_step``, loops ...; a file's tensors memory-mapped,
    read only when touched), verified against its checksums with ``check`` (a sharded folder's
    shard files too, unless ``files`` is False). Raises :class:`CheckpointError` (one line naming
    the path) for a missing, unsafe, damaged or foreign checkpoint."""
    path = Path(path)
    if path.is_dir() and not is_sharded(path):
        raise CheckpointError(
            f"{path} is a folder but not a checkpoint written by `builder train` (no .metadata and {META_FILE})"
        )
    if path.is_dir() and not (path / META_FILE).is_file():
        raise DamagedCheckpointError(f"{path} is damaged: {META_FILE} is missing")
    checkpoint = read_checkpoint(path / META_FILE if path.is_dir() else path, check=check)
    if not isinstance(checkpoint.get("builder"), Mapping):
        raise CheckpointError(not_ours(path, checkpoint))
    if check and files and path.is_dir():
        digests = checkpoint.get(SHARD_FILES)
        if not isinstance(digests, Mapping) or not digests:
            raise DamagedCheckpointError(f"{path} is damaged: {META_FILE} records no shard checksums")
        verify_files(path, digests)
    return checkpoint


def read_weights(path: str | Path, template: Mapping[str, Any] | None = None, check: bool = True) -> dict[str, Any]:
    """The LightningModule's whole tensors (``model.`` names) of a file or sharded checkpoint,
    verified with ``check``. A sharded checkpoint is read into ``template`` (the names and
    shapes to fill, e.g. a CPU model's ``state_dict`` with ``model.`` names) or, without one,
    into fresh CPU tensors of the model its own metadata describes."""
    path = Path(path)
    checkpoint = read_meta(path, check=check)
    if not is_sharded(path):
        if not isinstance(checkpoint.get(STATE_KEY), Mapping):
            raise CheckpointError(f"{path} holds no weights")
        return dict(checkpoint[STATE_KEY])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if template is None:
        template = {f"model.{k}": v for k, v in empty_model(checkpoint["builder"]["spec"], path).state_dict().items()}
    state = {STATE_KEY: dict(template)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise CheckpointError(f"cannot read the shards of {path}: {lines[-1][:200]}") from None
    return state[STATE_KEY]


def read_whole(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as the one dict a file checkpoint holds, verified: ``meta.pt``'s
    values, the whole weights under ``state_dict`` and each optimizer's state under
    ``optimizer_states`` keyed by parameter position (``torch.distributed.checkpoint`` keeps them
    by name), so a run saved under ``trainer.strategy: fsdp`` resumes in one process or under DDP.
    Every tensor is read whole into this process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    checkpoint = read_meta(path)
    state: dict[str, Any] = {}
    try:  # as DCP's own format_utils.dcp_to_torch_save reads a folder whole: tensors made from .metadata
        _load_state_dict(
            state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    except (Exception, CheckpointException) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise CheckpointError(f"cannot read the shards of {path}: {lines[-1][:200]}") from None
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


def checkpoint_spec(path: str | Path, data: Mapping[str, Any]):
    """A checkpoint's spec, validated against the blocks registered now; a one-line
    :class:`CheckpointError` naming ``path`` when it does not validate."""
    from pydantic import ValidationError

    from builder.spec.schema import ModelSpec, SpecRuleError

    try:
        return ModelSpec.model_validate(dict(data))
    except (ValidationError, SpecRuleError) as exc:
        first = str(exc).splitlines()[1 if isinstance(exc, ValidationError) else 0][:200]
        raise CheckpointError(
            f"{path}: its model spec does not validate here ({first}); a spec built from a "
            "plugin's blocks needs the same --plugin MODULE"
        ) from None


def empty_model(spec_data: Mapping[str, Any], path: str | Path = "the checkpoint"):
    """The spec's model on the CPU with uninitialised tensors (to be filled from a checkpoint)."""
    import torch

    from builder.assemble import build_model

    model = build_model(checkpoint_spec(path, spec_data), device="meta")
    return model.to_empty(device=torch.device("cpu"))


def model_weights(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The built model's tensors from a LightningModule state dict: the ``model.`` prefix and
    ``torch.compile``'s ``_orig_mod.`` wrapper taken off the names."""
    return {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def load_weights(model, weights: Mapping[str, Any], path: str | Path) -> None:
    """``weights`` (the built model's names) into ``model``, or a one-line :class:`CheckpointError`
    naming ``path`` and the first tensor its spec does not make (missing, unexpected, or of
    another shape) instead of torch's list of all of them."""
    import torch

    def shape(value) -> list[int] | str:
        return list(value.shape) if isinstance(value, torch.Tensor) else f"none (a {type(value).__name__})"

    own = model.state_dict()
    problems = [f"it lacks {name}" for name in own if name not in weights]
    problems += [
        f"{name} has shape {shape(weights[name])}, its spec makes {list(tensor.shape)}"
        for name, tensor in own.items()
        if name in weights and shape(weights[name]) != list(tensor.shape)
    ]
    problems += [f"it holds {name}, which its spec does not make" for name in weights if name not in own]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{path}: its weights do not fit its model spec: {problems[0]}{more}")
    model.load_state_dict(weights)


def load_model(path: str | Path):
    """``(model, meta)``: the trained model on the CPU in eval mode and the checkpoint's
    ``builder`` metadata (``global_step`` added), from a verified file or sharded checkpoint."""
    checkpoint = read_meta(path)
    builder = dict(checkpoint["builder"], global_step=checkpoint.get("global_step"))
    model = empty_model(builder["spec"], path)
    if is_sharded(path):  # the shards are read in place into the model's own tensors
        read_weights(path, {f"model.{k}": v for k, v in model.state_dict().items()}, check=False)
    else:
        load_weights(model, model_weights(checkpoint[STATE_KEY]), path)
    return model.eval(), builder


def consolidate(path: str | Path, out: str | Path) -> Path:
    """Write the model's whole weights of a checkpoint to one ``.safetensors`` file (a tied tensor
    once); the spec (JSON) and step go in its metadata. Written beside ``out`` and renamed over
    it, so a failed write leaves no partial file (a :class:`CheckpointError` says why)."""
    import json
    import os

    from builder.hf.weights import save_weights

    model, builder = load_model(path)
    metadata = {"spec": json.dumps(builder["spec"]), "global_step": str(builder.get("global_step"))}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # a failed write leaves no partial file
    try:
        save_weights(model, tmp, metadata=metadata)
        user_mode(tmp)
        os.replace(tmp, out)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, Exception):
            raise CheckpointError(f"cannot write {out}: {write_reason(exc)}") from None
        raise
    return out


def user_mode(path) -> None:
    """Give a file the mode the user's umask makes for new files (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_reason(exc: Exception) -> str:
    """Why a write failed, in words (safetensors reports the OS error inside its own message)."""
    import errno
    import re

    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and (found := re.search(r"(?:code: |os error )(\d+)", str(exc))):
        code = int(found.group(1))
    words = {
        errno.ENOSPC: "no space left on the device",
        errno.EFBIG: "file too large (the file-size limit)",
        errno.EROFS: "the filesystem is read-only",
        errno.EACCES: "permission denied",
        errno.ENOENT: "no such folder",
        errno.EISDIR: "it is a folder",
        errno.EEXIST: "a file is where its folder should be",
        errno.ENOTDIR: "a file is in its path",
    }
    if code in words:
        return words[code]
    return os.strerror(code) if code else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
