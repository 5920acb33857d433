"""A trained model back from a checkpoint alone: spec, weights and tokenizer; writing checkpoints
so that a failed or interrupted save never costs the previous one.

Every checkpoint is sealed with checksums of its tensors (:mod:`builder.integrity`) and
written to a temp file beside its name, flushed to disk, then renamed over it; ``last.ckpt``
keeps its predecessor from an earlier step as ``last-1.ckpt``, so a resume has an intact
checkpoint to fall back on when the newest is damaged. A save that fails (a full disk, a file-size limit, a read-only
folder) removes its temp file, leaves the previous checkpoint as it was and stops the run with
one line naming the file (:class:`CheckpointWriteError`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

from builder.checkpoints import model_weights
from recipes.data.tokenizers import from_state
from recipes.recipe.sections import RecipeError


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


#: checkpoints that keep their predecessor when saved again: name -> the predecessor's name
KEEPS_PREVIOUS = {"last.ckpt": "last-1.ckpt"}


class CheckpointWriteError(RecipeError):
    """A checkpoint that could not be written; the previous one is kept."""


def previous_path(path: Path) -> Path | None:
    """Where a checkpoint's predecessor is kept (``last.ckpt`` -> ``last-1.ckpt``), else None."""
    name = KEEPS_PREVIOUS.get(Path(path).name)
    return Path(path).with_name(name) if name else None


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


def _write_error(path: Path, exc: OSError) -> CheckpointWriteError:
    from recipes.training.run_folder import os_reason

    kept = f"the previous {path.name} is kept" if path.exists() else "no checkpoint was written"
    return CheckpointWriteError(f"could not write {path}: {os_reason(exc)}; {kept}")


def write_checkpoint(checkpoint: dict, path: str | Path) -> Path:
    """Seal ``checkpoint`` and write it to ``path`` atomically (see the module docstring)."""
    import torch

    from builder.integrity import seal

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
        from recipes.sharded_checkpoint import swap_into

        swap_into(tmp, path, checkpoint.get("global_step"))  # a predecessor of an earlier step kept (file or folder)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from None
        if isinstance(exc, RuntimeError) and writer is not None and writer.error is not None:
            raise _write_error(path, writer.error) from None
        raise
    return path


def _step_of(path: Path) -> int | None:
    """The step of the checkpoint file at ``path`` (its pickle only; tensors stay on disk), or
    None when there is none or it cannot be read (a damaged file is never kept as a predecessor)."""
    import torch

    if not path.is_file():
        return None
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step"))
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


def read_verified(path: str | Path) -> dict:
    """A checkpoint file, verified against its checksums: :class:`RecipeError` naming the file
    when it is missing, damaged or not loadable safely. One without checksums (written before
    they were added) loads with a note."""
    from builder.integrity import CheckpointError, is_sealed, read_checkpoint

    try:
        checkpoint = read_checkpoint(path)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    if not is_sealed(checkpoint) and isinstance(
        checkpoint.get("builder"), dict
    ):  # another program's: refused by the caller
        print(
            f"note: {path} has no checksums (written by an older builder); it is loaded unverified",
            file=sys.stderr,
            flush=True,
        )
    return checkpoint


#: the checkpoints of a run a resume may start from, newest first at equal steps (files, or
#: sharded folders under ``trainer.strategy: fsdp``)
RESUMABLE = ("last.ckpt", "last-1.ckpt", "best.ckpt")


def newest_intact(folder: Path) -> tuple[Path | None, dict | None, list[tuple[Path, Exception]]]:
    """``(path, checkpoint, damaged)``: the intact checkpoint of :data:`RESUMABLE` in ``folder``
    with the highest step (each file's step read from its pickle alone; then verified whole,
    newest first, until one passes) and the ``(path, error)`` of each damaged one met on the way."""
    from builder.checkpoints import CheckpointError, is_sharded, read_meta

    listed, damaged = [], []
    for order, name in enumerate(RESUMABLE):
        path = Path(folder) / name
        if not (path.is_file() or is_sharded(path)):
            continue
        try:
            step = int(read_meta(path, check=False).get("global_step") or 0)
        except (CheckpointError, TypeError, ValueError) as exc:
            damaged.append((path, exc))
            continue
        listed.append((step, -order, path))
    from recipes.training.run_folder import owns_run_folder

    for _, _, path in sorted(listed, reverse=True):
        try:  # a sharded folder's shard files are checked by rank 0, whose choice every rank loads
            return path, read_meta(path, files=owns_run_folder()), damaged
        except CheckpointError as exc:
            damaged.append((path, exc))
    return None, None, damaged


def load_trained(path: str | Path, device: str | None = None, folders: bool = False):
    """``(model, tokenizer, meta)`` from a checkpoint written by ``builder train`` (a file, or a
    sharded folder read whole into this process) or, with ``folders``, from a model folder (see
    :func:`load_folder`)."""
    from builder import build_model
    from builder.checkpoints import CheckpointError, is_sharded, load_model, load_weights

    path = Path(path)
    if is_sharded(path):
        try:
            model, meta = load_model(path)
        except CheckpointError as exc:
            raise RecipeError(str(exc)) from None
        return model.to(pick_device(device)).eval(), _checkpoint_tokenizer(path, meta.get("tokenizer")), meta
    if path.is_dir():
        if folders:
            return load_folder(path, device)
        raise RecipeError(f"{path} is a folder; this command needs a checkpoint written by `builder train`")
    checkpoint = read_verified(path)
    meta = checkpoint.get("builder")
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("spec"), dict)
        or not isinstance(checkpoint.get("state_dict"), dict)
        or not isinstance(meta.get("tokenizer"), dict)
    ):
        from builder.integrity import not_ours

        raise RecipeError(not_ours(path, checkpoint))
    spec = _checkpoint_spec(path, meta["spec"])
    tokenizer = _checkpoint_tokenizer(path, meta["tokenizer"])
    model = build_model(spec)
    try:
        load_weights(model, model_weights(checkpoint["state_dict"]), path)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    model.to(pick_device(device)).eval()
    meta = dict(meta, global_step=checkpoint.get("global_step"))
    return model, tokenizer, meta


def _checkpoint_tokenizer(path: Path, state: dict):
    """The checkpoint's tokenizer, or one line naming ``path`` when its record cannot rebuild one."""
    try:
        return from_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, OSError, RecipeError) as exc:
        reason = (
            f"no {exc}"
            if isinstance(exc, KeyError)
            else str(exc).strip().splitlines()[0][:160]
            if str(exc).strip()
            else type(exc).__name__
        )
        raise RecipeError(f"{path}: its tokenizer cannot be rebuilt ({reason})") from None


def load_folder(folder: Path, device: str | None = None):
    """``(model, tokenizer, meta)`` of a decoder-only model folder: a ``builder import-hf``
    output (``spec.yaml``, ``model.safetensors``) or a Hugging Face folder (``config.json`` and
    its weights), with the folder's tokenizer (``tokenizer.json``, else ``tokenizer.model``)."""
    from builder import build_model
    from builder.hf import HFError, from_hf, load_weights
    from builder.hf.tokenizer import read_tokenizer
    from builder.spec.loader import SpecError, load_spec

    try:
        if (folder / "spec.yaml").is_file():
            spec = load_spec(folder / "spec.yaml")
            model = load_weights(build_model(spec), folder / "model.safetensors")
        elif (folder / "config.json").is_file() or (folder / "config.json").is_symlink():
            spec, state = from_hf(folder)
            model = load_weights(build_model(spec), state)
        else:
            raise RecipeError(f"{folder} is not a model folder (no spec.yaml or config.json) nor a checkpoint")
        state = read_tokenizer(folder)
    except (HFError, SpecError) as exc:
        raise RecipeError(str(exc)) from None
    if spec.architecture != "decoder-only":
        raise RecipeError(
            f"{folder} holds an {spec.architecture} model; generating from a folder takes a decoder-only one"
        )
    if state is None:
        raise RecipeError(f"{folder} has no tokenizer (tokenizer.json or tokenizer.model) to encode the prompt with")
    tokenizer = from_state(state)
    if tokenizer.vocab_size > spec.vocab_size:
        raise RecipeError(
            f"{folder}: the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
            f"vocab_size {spec.vocab_size:,}"
        )
    model.to(pick_device(device)).eval()
    meta = {"task": "lm", "spec": spec.model_dump(mode="json"), "tokenizer": state, "global_step": None}
    return model, tokenizer, meta


def _checkpoint_spec(path: Path, data: dict):
    """The checkpoint's spec, validated against the blocks registered now."""
    from builder.checkpoints import CheckpointError, checkpoint_spec

    try:
        return checkpoint_spec(path, data)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
