"""A run folder that explains itself: the recipe as the run resolved it (``config.yaml``, a recipe
again), the same as the loggers' hyperparameters (``hparams.yaml``), and CSV and TensorBoard logs
that a resumed run continues instead of starting a new version.

Log versions: a new run (or ``--fresh``) writes ``logs/version_N`` and ``tensorboard/version_N``
with the next free N; a resumed run continues the latest, dropping what the interrupted run logged
after the checkpoint it resumes from (the CSV rows from that step on; TensorBoard's ``purge_step``),
so every step appears once.
"""

from __future__ import annotations

import csv
import json
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.recipe.loggers import LoggersSection
from yamlformer.recipes.say import publish
from yamlformer.recipes.training.run_folder import recipe_dump
from yamlformer.recipes.training.trackers import Background, flat_params, tracker_loggers

CONFIG = "config.yaml"
#: the run's estimate beside its measurements (:func:`estimate_params`), for ``builder report``
ESTIMATE = "estimate.json"
GIB = 2**30

_HEADER = """\
# The recipe as this run resolved it: every field with its value (defaults included), the model
# spec inline with its overrides applied, paths absolute. It is a recipe again:
#   builder train {path}                       # continues this run (--fresh: start it over)
#   builder train {path} --set trainer.output_dir=runs/again   # the same run in a new folder
"""


def resolved_recipe(run) -> dict[str, Any]:
    """The recipe of ``run`` (a :class:`yamlformer.recipes.training.resolved.Run`) as plain data
    that loads as a recipe from anywhere: every path absolute (:func:`recipe_dump`), the validated
    spec inline (no overrides left to apply)."""
    config = recipe_dump(run, working_dir=True)
    inline = {k: v for k, v in run.spec.model_dump(mode="json").items() if k != "extends"}  # resolved already
    config["model"] = {"spec": inline, "overrides": {}}
    config["trainer"]["output_dir"] = str(Path(run.out).resolve())
    return config


def write_config(out: Path, config: dict[str, Any]) -> Path:
    """``out/config.yaml``, written whole or not at all."""

    path = Path(out) / CONFIG
    text = _HEADER.format(path=path) + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    write_atomic(path, text.encode("utf-8"))
    return path


def log_version(out: Path, resuming: bool) -> int:
    """The log version of this run: the latest under ``out`` when resuming, else the next."""
    found = [
        int(m.group(1))
        for d in ("logs", "tensorboard")
        if (Path(out) / d).is_dir()
        for p in (Path(out) / d).iterdir()
        if (m := re.fullmatch(r"version_(\d+)", p.name))
    ]
    if not found:
        return 0
    return max(found) if resuming else max(found) + 1


def run_loggers(
    out: Path, resume_step: int | None, loggers=None, title: str = "run", parent_folder: Path | None = None
) -> list:
    """The loggers ``loggers`` (the recipe's ``trainer.loggers``; default CSV and TensorBoard)
    asks for under ``out``, continuing the latest version when ``resume_step`` (the step of the
    checkpoint resumed from) is given; the trackers (``yamlformer.recipes.training.trackers``)
    reopen their tracked runs then. ``parent_folder``: the run folder a branch started from."""
    loggers = loggers or LoggersSection()
    version = log_version(out, resume_step is not None)
    purge = {} if resume_step is None else {"purge_step": resume_step}
    made = []
    if loggers.csv:
        made.append(ContinuedCSVLogger(out, name="logs", version=version, resume_step=resume_step))
    if loggers.tensorboard:
        made.append(TensorBoardLogger(out, name="tensorboard", version=version, default_hp_metric=False, **purge))
    return made + tracker_loggers(loggers, out, title, resume_step is not None, parent_folder)


def record(trainer, out: Path, config: dict[str, Any], estimate: dict[str, Any] | None = None) -> None:
    """Write ``config.yaml`` and give every logger the resolved recipe as its hyperparameters;
    the trackers get it as one flat view with the ``estimate`` (:func:`estimate_params`) beside it."""
    if trainer.is_global_zero:
        write_config(out, config)
        if estimate:
            write_atomic(Path(out) / ESTIMATE, json.dumps(estimate, indent=1).encode())
    flat = flat_params({**config, "estimate": estimate or {}})
    for logger in trainer.loggers:
        logger.log_hyperparams(flat if isinstance(logger, Background) else config)


def estimate_params(est) -> dict[str, Any]:
    """What the run's estimate says beside what it measures: parameters, FLOPs per token, memory per rank."""
    return {
        "params_total": est.params.total,
        "params_trainable": est.params.trainable,
        "train_flops_per_token": est.flops.train_per_token,
        "memory_per_rank_bytes": est.memory.training_total,
    }


class StepStats(L.Callback):
    """At each log step (``every_n_steps``), in the row of the batch just trained: ``lr``, the
    learning rate that step applied (its optimizer's first parameter group, read before the step;
    Lightning steps the scheduler before ``on_train_batch_end``), and the peak memory so far, named
    for what it measures: ``cuda_max_allocated_gib`` (``torch.cuda.max_memory_allocated``: the
    tensors, not the caching allocator's reserve) on CUDA, else ``process_peak_rss_gib`` (the
    process's peak resident set, everything it holds). Host reads only: no device sync."""

    def __init__(self, every_n_steps: int):
        self.every_n_steps = every_n_steps
        self.lr: float | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if optimizer is trainer.optimizers[0]:
            self.lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches or trainer.global_step % self.every_n_steps:
            return
        metrics = {"lr": self.lr} if self.lr is not None else {}
        publish(trainer, {**metrics, **peak_memory(pl_module.device)})


def peak_memory(device: torch.device) -> dict[str, float]:
    """The peak memory so far, in GiB, under the name of what was measured (see :class:`StepStats`)."""
    if device.type == "cuda":
        return {"cuda_max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"process_peak_rss_gib": peak * (1 if sys.platform == "darwin" else 1024) / GIB}  # macOS: bytes


def close_trackers(trainer) -> None:
    """Flush and close the trackers (bounded: :data:`yamlformer.recipes.training.trackers.FLUSH_SECONDS`)."""
    for logger in trainer.loggers:
        if isinstance(logger, Background):
            logger.close()


class _ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` of a resumed run is kept
    (its rows before ``resume_step``) and appended to, instead of deleted."""

    def __init__(self, log_dir: str, resume_step: int | None):
        self.resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = self.metrics_file_path
        if self.resume_step is None or not os.path.isfile(path):
            super()._check_log_dir_exists()
            return
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            keys = list(reader.fieldnames or [])
            rows = [row for row in reader if _step(row) < self.resume_step]
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
        self.metrics_keys = keys  # new columns rewrite the header over these rows


def _step(row: dict) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


class ContinuedCSVLogger(CSVLogger):
    """:class:`CSVLogger` whose ``metrics.csv`` a resumed run continues (see :class:`_ContinuedWriter`)."""

    def __init__(self, *args, resume_step: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> _ContinuedWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self.resume_step)
        return self._experiment
