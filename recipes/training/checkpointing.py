"""The Lightning side of a run's checkpoints: the checkpoint IO a run writes and resumes through,
and the callback that says when to save (``last.ckpt``, ``best.ckpt``; a task may add its own,
as translation keeps the ``step-N.ckpt`` its averaging needs). What a checkpoint is, and every
write and read of one, is :mod:`yamlformer.builder.checkpoints`; its errors become the run's one
line (:func:`yamlformer.recipes.parallel.checkpoints.run_errors`), and a resume's checks of a
sharded folder's files are left to the process that owns the run folder.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from yamlformer.builder import checkpoints
from yamlformer.recipes.parallel.checkpoints import run_errors
from yamlformer.recipes.training.run_folder import owns_run_folder


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO through :func:`yamlformer.builder.checkpoints.write_checkpoint`: sealed with
    tensor checksums, written to a temp file beside the target, fsynced and renamed over it
    (``last.ckpt`` keeping its predecessor as ``last-1.ckpt``). A run killed mid-write leaves the
    previous checkpoint whole; a failed write removes its temp file and stops the run in one line
    (:class:`yamlformer.recipes.parallel.checkpoints.RunCheckpointWriteError`)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with run_errors():
            checkpoints.write_checkpoint(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """The checkpoint a run resumes from — a file, or a sharded folder (a run saved under
        ``trainer.strategy: fsdp``) read whole — read as every checkpoint is read: weights only,
        never by unpickling arbitrary objects, and from the read that verified it when the resume
        chose it (:func:`yamlformer.builder.checkpoints.read_for_resume`); a file changed since is named in
        one line."""
        with run_errors("--resume: "):
            return checkpoints.read_for_resume(path)


def newest_intact(folder: Path):
    """:func:`yamlformer.builder.checkpoints.newest_intact` of a run's checkpoints folder: a sharded folder's
    shard files are checked by the process that owns the run folder (rank 0), whose choice every
    rank loads."""
    return checkpoints.newest_intact(folder, files=owns_run_folder())


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
