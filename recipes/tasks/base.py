"""The tasks besides language modelling (``task: translation | mlm | classification``): one run
loop for all of them, on the LM recipe's machinery (Trainer, checkpoints, resuming, logs).

Each task module (``recipes.tasks.translation``, ``recipes.tasks.encoder``) has ``prepare(recipe, recipe_file)``
returning a :class:`Prepared`: the tokenizer, the validated spec, the data module, the
LightningModule class and what the run does before and after training. ``builder eval`` and
``builder generate`` reach a task through :func:`evaluate` and :func:`generate`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from recipes.parallel import data_parallel_size
from recipes.recipe.sections import Recipe, RecipeError
from recipes.training.callbacks import RecipeCheckpoint, Throughput

#: task -> the module that implements it
MODULES = {
    "translation": "recipes.tasks.translation",
    "mlm": "recipes.tasks.encoder",
    "classification": "recipes.tasks.encoder",
}

#: sentencepiece trainer settings for prose (over the LM's code-oriented ones): NFKC, a word-start
#: marker on the first word too, runs of spaces folded
PROSE = {
    "normalization_rule_name": "nmt_nfkc",
    "add_dummy_prefix": True,
    "remove_extra_whitespaces": True,
    "allow_whitespace_only_pieces": False,
}


@dataclasses.dataclass
class Prepared:
    """What a task hands the shared run loop."""

    tokenizer: Any
    spec: Any
    data: L.LightningDataModule
    module_class: type
    tokens_of: Callable  # a micro-batch -> the real (non-pad) tokens it trains on (an int or a device tensor)
    seq_len: int  # the typical example length, for the start-of-run estimate
    meta: dict = dataclasses.field(default_factory=dict)  # task facts kept in checkpoints (labels...)
    init: Callable | None = None  # model -> None: weights from elsewhere (a pretrained encoder)
    callbacks: Callable | None = None  # checkpoint dir -> extra callbacks
    finish: Callable | None = None  # (module, whole model, checkpoint dir) -> final metrics, printed and returned


def task_module(task: str):
    if task not in MODULES:
        raise RecipeError(f"unknown task {task!r}; one of lm, {', '.join(MODULES)}")
    return importlib.import_module(MODULES[task])


class CountedThroughput(Throughput):
    """:class:`Throughput` for batches of varying size: the real tokens of each micro-batch
    (``tokens_of``) are summed on the device and read at the interval's end, times the world size."""

    def __init__(self, tokens_of: Callable, flops_per_token: int, precision: str, every_n_steps: int):
        super().__init__(0, flops_per_token, precision, every_n_steps)
        self.tokens_of = tokens_of
        self._tokens = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._tokens = self._tokens + self.tokens_of(batch)  # a device tensor for some tasks: no read here
        self._world = data_parallel_size(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def interval_tokens(self) -> float:
        tokens, self._tokens = float(self._tokens), 0
        return tokens * self._world

    def on_validation_end(self, trainer, pl_module):
        super().on_validation_end(trainer, pl_module)
        self._tokens = 0


def run_task(
    recipe: Recipe,
    recipe_file: Path,
    resume: str | bool | None = None,
    fresh: bool = False,
    callbacks: list | None = None,
    verbose: bool = False,
) -> dict:
    """Train a non-LM recipe (the shape of ``recipes.training.run.run``, in the same run session);
    returns its summary. ``callbacks``: more Lightning callbacks (a benchmark's clock)."""
    from recipes.training.run import for_this_machine, output_dir, run_session

    recipe = for_this_machine(recipe)
    out = output_dir(recipe, recipe_file)
    with run_session(recipe, out, fresh, resume, recipe_file=recipe_file) as stop:
        return _train_task(recipe, recipe_file, out, stop, resume, fresh, callbacks, verbose)


def _train_task(
    recipe: Recipe,
    recipe_file: Path,
    out: Path,
    stop,
    resume: str | bool | None,
    fresh: bool,
    callbacks: list | None,
    verbose: bool = False,
) -> dict:
    from recipes.parallel import whole_model
    from recipes.training.run import (
        check_layout,
        fit,
        quiet_lightning,
        resume_path,
        run_trainer,
        say_devices,
        stop_callback,
        training_meta,
        training_model,
        wrap_up,
    )
    from recipes.training.speed import compiling, eager

    settings = recipe.trainer
    quiet_lightning()
    check_layout(recipe, recipe_file)
    say_devices(recipe)
    L.seed_everything(settings.seed, workers=True, verbose=False)
    prepared = task_module(recipe.task).prepare(recipe, recipe_file)
    meta = training_meta(recipe, recipe_file, prepared.spec, prepared.tokenizer, task=recipe.task, **prepared.meta)
    ckpt = resume_path(out, resume, fresh, meta)  # before the model: a run that cannot resume stops here
    model, flops_per_token = training_model(
        prepared.spec,
        recipe,
        prepared.init,
        seq_len=prepared.seq_len,
        batch=1,
        recipe_file=recipe_file,
        verbose=verbose,
    )
    module = prepared.module_class(model, recipe, meta)
    ckpt_dir = out / "checkpoints"
    checkpoints = RecipeCheckpoint(ckpt_dir, settings.checkpoint_every_n_steps)
    throughput = CountedThroughput(prepared.tokens_of, flops_per_token, settings.precision, settings.log_every_n_steps)
    extra = prepared.callbacks(ckpt_dir) if prepared.callbacks is not None else []
    trainer = run_trainer(
        recipe,
        recipe_file,
        prepared.spec,
        out,
        [checkpoints, throughput, *extra, *(callbacks or []), stop_callback(stop, checkpoints)],
        ckpt,
    )
    with compiling(out) as compiled:
        fit(trainer, module, prepared.data, ckpt)
    with eager():
        summary = wrap_up(
            trainer,
            module,
            prepared.data,
            throughput,
            checkpoints,
            out,
            f"{recipe.name or recipe_file.stem}: {prepared.spec.name}",
            compiled,
        )
        summary.update(task=recipe.task, val_metrics=dict(getattr(module, "val_metrics", {})))
        if prepared.finish is not None:
            model = whole_model(module)  # every rank: a sharded model is gathered to rank 0
            if trainer.is_global_zero:
                summary.update(prepared.finish(module, model, ckpt_dir))
    return summary


def check_task(meta: dict, *tasks: str) -> None:
    if meta.get("task", "lm") not in tasks:
        raise RecipeError(f"this checkpoint was trained for task {meta.get('task', 'lm')!r}, not {' or '.join(tasks)}")


def evaluate(model, tokenizer, meta: dict, args) -> dict:
    """``builder eval`` on a checkpoint of a task: the task's own metrics."""
    return task_module(meta["task"]).evaluate(model, tokenizer, meta, args)


def generate(model, tokenizer, meta: dict, args) -> str:
    """``builder generate`` on a checkpoint of a task: a translation, or a predicted label."""
    return task_module(meta["task"]).generate(model, tokenizer, meta, args)
