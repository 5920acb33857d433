"""A run's checkpoint faults as its one-line errors (:func:`run_errors`), and the sharded save
and load every rank of a ``trainer.strategy: fsdp`` run makes through them; the work is
:mod:`yamlformer.builder.checkpoints`'. The sharded strategy (:mod:`.strategy`) saves and loads
here; a run's unsharded checkpoint IO and callbacks (``yamlformer.recipes.training.checkpointing``,
a task's) name their faults with :func:`run_errors` too."""

from __future__ import annotations

import contextlib
from pathlib import Path

from yamlformer.builder import checkpoints
from yamlformer.builder.checkpoints import CheckpointError, CheckpointWriteError
from yamlformer.recipes.errors import RecipeError


class RunCheckpointWriteError(CheckpointWriteError, RecipeError):
    """A checkpoint a run could not write (the previous one kept): the run stops with its line."""


@contextlib.contextmanager
def run_errors(prefix: str = ""):
    """A checkpoint's fault as the run's one-line error (``prefix`` before a read's)."""
    try:
        yield
    except CheckpointWriteError as exc:
        raise RunCheckpointWriteError(str(exc)) from None
    except CheckpointError as exc:
        raise RecipeError(f"{prefix}{exc}") from None


def save_sharded(checkpoint: dict, path: Path, tmp: Path, rank: int, ranks: int, barrier) -> None:
    """:func:`yamlformer.builder.checkpoints.save_sharded` (every rank calls it), its failure the run's line."""
    with run_errors():
        checkpoints.save_sharded(checkpoint, path, tmp, rank, ranks, barrier)


def load_into_shards(module, optimizers, path: Path, strict: bool = True, whole_groups=None) -> dict:
    """:func:`yamlformer.builder.checkpoints.load_into_shards`: a file checkpoint into a sharded run's ranks."""
    with run_errors("--resume: "):
        return checkpoints.load_into_shards(module, optimizers, path, strict=strict, whole_groups=whole_groups)
