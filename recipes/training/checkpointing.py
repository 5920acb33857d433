"""The Lightning side of a run's checkpoints: the checkpoint IO a run writes and resumes through,
and the callbacks that say when to save (``last.ckpt``, ``best.ckpt``; the kept ``step-N.ckpt``
that averaging needs). What a checkpoint is, and every write and read of one, is
:mod:`yamlformer.builder.checkpoints`; here its errors become the run's one line
(:class:`~yamlformer.recipes.errors.RecipeError`), and a resume's checks of a sharded folder's files are
left to the process that owns the run folder.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from yamlformer.builder import checkpoints
from yamlformer.builder.checkpoints import CheckpointError, CheckpointWriteError
from yamlformer.recipes.errors import RecipeError


class RunCheckpointWriteError(CheckpointWriteError, RecipeError):
    """A checkpoint a run could not write (the previous one kept): the run stops with its line."""


@contextlib.contextmanager
def _run_errors(prefix: str = ""):
    """A checkpoint's fault as the run's one-line error (``prefix`` before a read's)."""
    try:
        yield
    except CheckpointWriteError as exc:
        raise RunCheckpointWriteError(str(exc)) from None
    except CheckpointError as exc:
        raise RecipeError(f"{prefix}{exc}") from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO through :func:`yamlformer.builder.checkpoints.write_checkpoint`: sealed with
    tensor checksums, written to a temp file beside the target, fsynced and renamed over it
    (``last.ckpt`` keeping its predecessor as ``last-1.ckpt``). A run killed mid-write leaves the
    previous checkpoint whole; a failed write removes its temp file and stops the run in one line
    (:class:`RunCheckpointWriteError`)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with _run_errors():
            checkpoints.write_checkpoint(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """The checkpoint a run resumes from — a file, or a sharded folder (a run saved under
        ``trainer.strategy: fsdp``) read whole — read as every checkpoint is read: weights only,
        never by unpickling arbitrary objects, and from the read that verified it when the resume
        chose it (:func:`yamlformer.builder.checkpoints.read_for_resume`); a file changed since is named in
        one line."""
        with _run_errors("--resume: "):
            return checkpoints.read_for_resume(path)


def newest_intact(folder: Path):
    """:func:`yamlformer.builder.checkpoints.newest_intact` of a run's checkpoints folder: a sharded folder's
    shard files are checked by the process that owns the run folder (rank 0), whose choice every
    rank loads."""
    from yamlformer.recipes.training.run_folder import owns_run_folder

    return checkpoints.newest_intact(folder, files=owns_run_folder())


def save_sharded(checkpoint: dict, path: Path, tmp: Path, rank: int, ranks: int, barrier) -> None:
    """:func:`yamlformer.builder.checkpoints.save_sharded` (every rank calls it), its failure the run's line."""
    with _run_errors():
        checkpoints.save_sharded(checkpoint, path, tmp, rank, ranks, barrier)


def load_into_shards(module, optimizers, path: Path, strict: bool = True, whole_groups=None) -> dict:
    """:func:`yamlformer.builder.checkpoints.load_into_shards`: a file checkpoint into a sharded run's ranks."""
    with _run_errors("--resume: "):
        return checkpoints.load_into_shards(module, optimizers, path, strict=strict, whole_groups=whole_groups)


def branch_path(dirpath: Path, step: int) -> Path:
    """Where the whole checkpoint kept at optimizer step ``step`` is written (``keep_every_n_steps``)."""
    return Path(dirpath) / f"branch-{step}.ckpt"


class RecipeCheckpoint(L.Callback):
    """``last.ckpt`` every ``every_n_steps`` optimizer steps, at each validation and at the end;
    ``best.ckpt`` whenever the validation loss improves; with ``keep_every_n_steps``, a whole
    checkpoint ``branch-N.ckpt`` kept every that many steps (a cooldown branches from one)."""

    def __init__(self, dirpath: Path, every_n_steps: int, keep_every_n_steps: int | None = None):
        self.dirpath, self.every_n_steps, self.keep_every_n_steps = Path(dirpath), every_n_steps, keep_every_n_steps
        self.best: float | None = None
        self._saved_step = -1

    @property
    def last_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    @property
    def best_path(self) -> Path:
        return self.dirpath / "best.ckpt"

    def _save_last(self, trainer, force: bool = False) -> Path:
        if force or trainer.global_step != self._saved_step:
            trainer.save_checkpoint(self.last_path, weights_only=False)
            self._saved_step = trainer.global_step
        return self.last_path

    def save_last(self, trainer) -> Path:
        """``last.ckpt`` at this step (unless it was just written); every rank calls it."""
        return self._save_last(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self._save_last(trainer)
        keep = self.keep_every_n_steps
        if stepped and keep is not None and trainer.global_step % keep == 0:
            path = branch_path(self.dirpath, trainer.global_step)
            if not checkpoints.exists(path):
                trainer.save_checkpoint(path, weights_only=False)

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self._save_last(trainer, force=True)  # again: now with this validation in the history
        loss = float(trainer.callback_metrics["val_loss"])
        if self.best is None or loss < self.best:
            self.best = loss
            trainer.save_checkpoint(self.best_path, weights_only=False)

    def on_train_end(self, trainer, pl_module):
        flush = getattr(pl_module, "flush_losses", None)  # the losses of the steps since the last log
        self._save_last(trainer, force=bool(flush is not None and flush(log=False)))

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best = state_dict.get("best")


class KeepLastCheckpoints(L.Callback):
    """Weights every ``every_n_steps`` optimizer steps (and at the end) as ``step-N.ckpt``, the last
    ``keep`` of them kept; at the end of training their average goes to ``averaged.ckpt``
    (:mod:`yamlformer.builder.checkpoints.averaging`)."""

    def __init__(self, dirpath: Path, keep: int, every_n_steps: int):
        self.dirpath, self.keep, self.every_n_steps = Path(dirpath), keep, every_n_steps
        self.averaged_path = self.dirpath / "averaged.ckpt"

    def _save(self, trainer) -> None:
        path = checkpoints.step_path(self.dirpath, trainer.global_step)
        if checkpoints.exists(path):
            return
        trainer.save_checkpoint(path, weights_only=True)
        if trainer.is_global_zero:
            for old in checkpoints.kept_checkpoints(self.dirpath)[: -self.keep]:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step == 0:
            return
        self._save(trainer)
        if trainer.is_global_zero:
            with _run_errors():
                checkpoints.average_checkpoints(checkpoints.kept_checkpoints(self.dirpath), self.averaged_path)
