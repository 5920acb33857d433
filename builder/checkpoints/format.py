"""What a ``builder train`` checkpoint holds, and the names it is found by.

A checkpoint is one ``torch.save`` file, or a folder written by ``torch.distributed.checkpoint``
(``.metadata`` and ``__R_N.distcp`` shard files for the tensors, :data:`META_FILE` for the rest).
Either way it holds the LightningModule's weights under :data:`STATE_KEY` (``model.`` names), the
loops' state, the step, and the ``builder`` record: the model spec, the recipe and the tokenizer,
so eval, generate and export need nothing else. This module names those parts, tells a checkpoint
from other files and folders, and turns a checkpoint's spec and weights into a model; the errors
every reader and writer of the package raises are defined here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from yamlformer.builder.spec.schema import ModelSpec, SpecRuleError

#: the file beside the shards that holds everything but tensors (Lightning's ``_METADATA_FILENAME``)
META_FILE = "meta.pt"
#: the key in ``meta.pt`` of every shard file's CRC-32 (sealed with ``meta.pt``'s other values)
SHARD_FILES = "shard_files"
#: the key the LightningModule's weights sit under, in a file checkpoint and in the shards alike
STATE_KEY = "state_dict"
#: the key of the ``builder`` record (spec, recipe, tokenizer)
BUILDER_KEY = "builder"
#: what a file written by ``torch.save`` is named
SUFFIXES = (".ckpt", ".pt", ".pth")
#: the checkpoints of a run a resume may start from, newest first at equal steps (files, or
#: sharded folders under ``trainer.strategy: fsdp``)
RESUMABLE = ("last.ckpt", "last-1.ckpt", "best.ckpt")
#: checkpoints that keep their predecessor when saved again: name -> the predecessor's name
KEEPS_PREVIOUS = {"last.ckpt": "last-1.ckpt"}


class CheckpointError(ValueError):
    """A path that is not a readable ``builder train`` checkpoint."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose bytes are not the ones written: empty, truncated, overwritten, or a
    tensor or value that does not match its checksum."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written; the previous one is kept."""


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder written by ``torch.distributed.checkpoint`` (its
    ``.metadata`` or our ``meta.pt`` there: a folder that lost one is a damaged checkpoint, which
    the readers name, not some other folder)."""
    path = Path(path)
    return path.is_dir() and ((path / ".metadata").is_file() or (path / META_FILE).is_file())


def exists(path: str | Path) -> bool:
    """A checkpoint is at ``path``: a file, or a sharded folder with its metadata."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / ".metadata").is_file() and (path / META_FILE).is_file())


def looks_like_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is meant as a checkpoint, not a spec: its suffix, else its first bytes (the
    zip archive ``torch.save`` writes, or a pickle)."""
    path = Path(path)
    if path.suffix in SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def previous_path(path: str | Path) -> Path | None:
    """Where a checkpoint's predecessor is kept (``last.ckpt`` -> ``last-1.ckpt``), else None."""
    name = KEEPS_PREVIOUS.get(Path(path).name)
    return Path(path).with_name(name) if name else None


def not_ours(path: str | Path, checkpoint: Mapping[str, Any]) -> str:
    """The words for a loadable checkpoint that ``builder train`` did not write (no ``builder``
    record with its spec, weights and tokenizer): whose it looks like, when that can be told."""
    why = (
        "a Lightning checkpoint of another program"
        if "pytorch-lightning_version" in checkpoint
        else "it has no spec, weights or tokenizer"
    )
    return f"{path} was not written by `builder train` ({why})"


def checkpoint_spec(path: str | Path, data: Mapping[str, Any]):
    """A checkpoint's spec, validated against the blocks registered now; a one-line
    :class:`CheckpointError` naming ``path`` when it does not validate."""

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
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    from yamlformer.builder.assemble import build_model

    model = build_model(checkpoint_spec(path, spec_data), device="meta")
    return model.to_empty(device=torch.device("cpu"))


def model_weights(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The built model's tensors from a LightningModule state dict: the ``model.`` prefix and
    ``torch.compile``'s ``_orig_mod.`` wrapper taken off the names."""
    return {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def lightning_names(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A built model's state dict under the LightningModule's names (``model.`` before each)."""
    return {f"model.{k}": v for k, v in state_dict.items()}


def load_weights(model, weights: Mapping[str, Any], path: str | Path) -> None:
    """``weights`` (the built model's names) into ``model``, or a one-line :class:`CheckpointError`
    naming ``path`` and the first tensor its spec does not make (missing, unexpected, or of
    another shape) instead of torch's list of all of them."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
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
