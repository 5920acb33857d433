"""What a run shows, once: lines on stdout on rank 0 only (every rank runs the same code), and
the training metrics known on the host on the progress bar and in the loggers (:func:`publish`:
the LightningModule's losses and the callbacks' throughput alike)."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from tqdm import tqdm


def say(*args) -> None:
    """One line on stdout, on rank 0. While a progress bar is drawn there (the training bar is
    tqdm's, so is every bar a task draws) the line goes above it, through tqdm's own writer: a
    line printed by another thread (a tracker's warning) would otherwise land in the middle of the
    bar's line."""
    if rank_zero_only.rank != 0:
        return
    tqdm.write(" ".join(str(arg) for arg in args), file=sys.stdout)
    sys.stdout.flush()


def publish(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Training metrics known on the host (a loss read at a log step, the throughput) shown on the
    progress bar and written to the run's loggers (rank zero), in the row Lightning's own logging
    would write them: the step of the batch just trained (``global_step - 1``) and the epoch.
    Not through ``LightningModule.log``: a value logged there stays in Lightning's results as a
    device tensor that it reads back at every later step, a GPU synchronisation each time."""
    shown = getattr(trainer.progress_bar_callback, "shown", None)
    if shown is not None:
        shown.update(metrics)
    if trainer.is_global_zero:
        row = dict(metrics, epoch=trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics(row, step=max(0, trainer.global_step - 1))
