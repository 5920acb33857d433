"""`builder train RECIPE`: corpus, tokenizer, model, Lightning Trainer, checkpoints, samples.

A run writes everything under its output dir: ``config.yaml`` (the resolved recipe, a recipe
again), ``checkpoints/last.ckpt`` and ``best.ckpt``, CSV and TensorBoard logs, ``loss.png``.
Running the same recipe again resumes from ``last.ckpt`` (same step, optimizer, schedule, data
position and random state); ``--fresh`` starts over.
While it runs, the folder is checked writable and locked (:mod:`yamlformer.recipes.training.run_folder`) and a
signal saves a checkpoint and stops it (:mod:`yamlformer.recipes.training.signals`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console

from yamlformer.builder.analysis.report import print_describe, summary_line
from yamlformer.builder.assemble import build_model
from yamlformer.builder.checkpoints import RESUMABLE, CheckpointError, peek_meta, read_meta, tidy
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.parallel import device_count, layout_of, parallelize, whole_model
from yamlformer.recipes.parallel.compile import compiling, eager
from yamlformer.recipes.parallel.launcher import SharedRunFolder, check_launcher, wait_for_rank_zero
from yamlformer.recipes.parallel.rendezvous import run_process_group
from yamlformer.recipes.parallel.strategy import ShardedStrategy
from yamlformer.recipes.recipe.located import LocatedRecipe
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.say import say
from yamlformer.recipes.tasks import load_recipe
from yamlformer.recipes.training.callbacks import (
    CountedThroughput,
    InvocationTimer,
    StepProgressBar,
    Throughput,
    plot_losses,
    stop_line,
)
from yamlformer.recipes.training.checkpointing import AtomicCheckpointIO, RecipeCheckpoint, newest_intact
from yamlformer.recipes.training.dry_run import devices_line, recipe_estimate
from yamlformer.recipes.training.precision import lightning_plugin, matmul_precision, on_cuda, resolve_precision
from yamlformer.recipes.training.pretrained import freeze_parts, load_init_from
from yamlformer.recipes.training.requeue import requeue
from yamlformer.recipes.training.resolved import Run, resolve_run
from yamlformer.recipes.training.resume import builder_meta, check_recipe_early, given_checkpoint, trained_differently
from yamlformer.recipes.training.run_folder import claim, owns_run_folder, recipe_dump, resume_differences
from yamlformer.recipes.training.run_log import (
    StepStats,
    close_trackers,
    estimate_params,
    record,
    resolved_recipe,
    run_loggers,
)
from yamlformer.recipes.training.signals import SignalStop
from yamlformer.recipes.training.stop_on_signal import StopOnSignal
from yamlformer.recipes.training.trackers import check_clients


class _Quiet(logging.Filter):
    """Drops Lightning's advertising and chatter that says nothing about this run, or that the
    run says itself: the accelerators (the devices line), the checkpoint restored ("resuming
    from"), why fit stopped (:func:`yamlformer.recipes.training.callbacks.stop_line`)."""

    NOISE = (
        "litlogger",
        "`weights_only` was not set",
        "LeafSpec",
        "IterableDataset` has `__len__`",
        "GPU available:",
        "TPU available:",
        "HPU available:",
        "Restoring states from the checkpoint",
        "Restored all states from the checkpoint",
        "`Trainer.fit` stopped:",
        "does not have many workers",
        "set_float32_matmul_precision",  # trainer.matmul_precision sets it (make_trainer)
        "The `srun` command is available on your system but is not used",  # a run outside SLURM is meant so
    )  # one worker makes batches far faster than a step takes them

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in record.getMessage() for noise in self.NOISE)


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).addFilter(_Quiet())
    for noise in _Quiet.NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(noise)}.*")


def say_devices(run: Run) -> None:
    """The run's devices, strategy and precision in one line (Lightning's own lines are filtered)."""
    say(f"devices: {devices_line(run.recipe, run.precision_note, run.precision)}")


def describe(run: Run, model, seq_len: int, batch: int, verbose: bool = False) -> int:
    """Print the start-of-run estimate at ``seq_len`` tokens x ``batch`` sequences, checked against
    the built parameters: one line, or with ``verbose`` the full tables ``builder describe``
    prints. Returns the estimate."""
    # under fsdp: what each rank holds in this layout (yamlformer.builder.analysis.layout)
    devices = device_count(run.recipe.trainer)
    est = recipe_estimate(run.spec, run.recipe, seq_len, batch, devices, run.precision, run.reference)
    if rank_zero_only.rank == 0:
        if verbose:
            print_describe(run.spec, est, actual=model)
        else:
            Console().print(
                f"model: {summary_line(run.spec, est, actual=model)} (--verbose: the full estimate)",
                highlight=False,
                soft_wrap=True,
            )
    return est


def training_model(
    run: Run, init=None, seq_len: int | None = None, batch: int | None = None, verbose: bool = False
) -> tuple:
    """The model stage, for every task: the run's spec built (seeded), weights loaded from
    ``model.init_from`` (then ``init``, a task's own loading), parts frozen, its describe table
    printed at ``seq_len`` x ``batch`` (default: the run's), layers checkpointed and compiled as
    the recipe asks. Under ``strategy: fsdp`` it is built on the meta device (unless weights are
    loaded into it) and the strategy shards, checkpoints, compiles and materialises it
    (``yamlformer.recipes.parallel``). Returns ``(model, its estimate)``."""
    recipe = run.recipe
    settings = recipe.trainer
    sharded = settings.strategy == "fsdp"
    torch.manual_seed(settings.seed)
    on_meta = sharded and init is None and recipe.model.init_from is None
    model = build_model(
        run.spec,
        device="meta" if on_meta else None,
        init_seed=settings.seed,
        dtype=torch.bfloat16 if settings.precision == "bf16-true" else None,
    )
    load_init_from(model, run)
    if init is not None:
        init(model)
    freeze_parts(model, run)
    est = describe(run, model, seq_len or run.seq_len, batch or run.batch, verbose=verbose)
    if sharded:
        return model, est  # the strategy parallelises it on its mesh (ShardedStrategy.parallelize)
    return parallelize(model, settings), est  # checkpointing and compile as the recipe asks


def for_this_machine(recipe: Recipe, quiet: bool = False) -> Recipe:
    """The recipe with ``trainer.precision`` made concrete for this machine (``auto`` resolved by
    ``yamlformer.recipes.training.precision.resolve_precision``; a line printed when the choice needs explaining,
    unless ``quiet``)."""
    settings = recipe.trainer
    precision, note = resolve_precision(settings.precision, settings.accelerator)
    if note and not quiet:
        say(note)
    return recipe.model_copy(update={"trainer": settings.model_copy(update={"precision": precision})})


def training_meta(run: Run, tokenizer, **extra) -> dict:
    """What a checkpoint carries besides weights, so eval and generate need nothing else (the
    weights the run started from: ``model.init_from``'s, absolute, or None: drawn, seeded)."""
    return {
        "spec": run.spec.model_dump(mode="json"),
        "recipe": recipe_dump(run),  # its data paths absolute
        "recipe_file": str(run.file),
        "starting_weights": str(run.source.path.resolve()) if run.source is not None else None,
        "tokenizer": tokenizer.state(),
        **extra,
    }


def check_devices(recipe: Recipe) -> None:
    """The devices the recipe asks for are on this machine, in a layout they split into (the
    dry run shows one this machine lacks with a warning instead)."""
    if recipe.trainer.strategy == "fsdp":
        layout_of(recipe.trainer)
    else:
        device_count(recipe.trainer)


def strategy_for(recipe: Recipe):
    """The Lightning strategy: FSDP2 / tensor parallelism (``yamlformer.recipes.parallel.strategy``)
    or Lightning's own."""
    trainer = recipe.trainer
    if trainer.strategy == "fsdp":
        return ShardedStrategy(trainer, init_seed=trainer.seed)
    return trainer.strategy


def plugins_for(recipe: Recipe) -> list:
    """Lightning's plugins: the precision plugin (``yamlformer.recipes.training.precision``: it clips correctly under
    every precision with fused AdamW; under ``strategy: fsdp`` FSDP2's policy casts and gradients
    clip across meshes) and, unless the sharded strategy saves checkpoints itself, atomic IO."""
    settings = recipe.trainer
    device = "cuda" if on_cuda(settings.accelerator) else "cpu"
    sharded = settings.strategy == "fsdp"
    plugin = lightning_plugin(settings.precision, device, sharded=sharded)
    return [plugin] if sharded else [plugin, AtomicCheckpointIO()]


def resume_path(out: Path, resume: str | bool | None, fresh: bool, meta: dict | None = None) -> Path | None:
    """The checkpoint this run resumes from: ``--resume PATH``, else (unless ``--fresh``) the
    newest intact of the run's ``last.ckpt``, ``last-1.ckpt`` and ``best.ckpt``. A damaged one
    is set aside as ``NAME.damaged`` with a message; ``--resume PATH`` that is damaged is an
    error. With ``meta``, the checkpoint is checked to be this recipe's (:func:`check_resumable`)."""
    if isinstance(resume, str):
        path = given_checkpoint(resume)
        try:
            saved = read_meta(path)
        except CheckpointError as exc:
            raise RecipeError(f"--resume: {exc}") from None
        if meta is not None:
            check_resumable(path, meta, saved)
        return path
    folder = out / "checkpoints"
    if not fresh and owns_run_folder():
        for name in RESUMABLE:
            tidy(folder / name)  # a sharded save that died between its renames is put back
    path, saved, damaged = (None, None, []) if fresh else newest_intact(folder)
    _set_aside_damaged(damaged, path, saved)
    if path is None:
        if resume:
            raise RecipeError(f"--resume: no {folder / 'last.ckpt'} to resume from")
        return None
    if meta is not None:
        check_resumable(path, meta, saved)
    return path


def _set_aside_damaged(damaged: list, chosen: Path | None, saved: dict | None) -> None:
    """Rename each damaged checkpoint ``NAME.damaged`` (so a later save never keeps it as a
    predecessor) and say what the run resumes from instead; an error when nothing is left."""
    for path, exc in damaged:
        kept = ""
        if owns_run_folder():
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(path.name + ".damaged"))
                kept = f"; it is kept as {path.name}.damaged"
        if chosen is None:
            raise RecipeError(
                f"{exc}{kept}; no intact checkpoint is left in {path.parent} to resume from: start over with --fresh"
            )
        say(f"{exc}{kept}; resuming from {chosen} (step {saved.get('global_step')}) instead")


def check_resumable(path: Path, meta: dict, saved: dict | None = None) -> None:
    """Refuse to resume ``path`` when the recipe, spec, tokenizer or corpus that shaped it differ
    from this run's, one line per field (``yamlformer.recipes.training.run_folder.MAY_CHANGE`` lists what may change,
    and those changes are printed)."""
    if saved is None:
        try:
            saved = peek_meta(path)
        except CheckpointError as exc:
            raise RecipeError(f"--resume: {exc}") from None
    refused, allowed = resume_differences(builder_meta(path, saved), meta, step=saved.get("global_step"))
    if refused:
        raise trained_differently(path, refused)
    for line in allowed:
        say(f"resuming with a changed setting: {line}")


def make_trainer(
    recipe: Recipe, out: Path, callbacks: list, resume_step: int | None = None, parent_folder: Path | None = None
) -> L.Trainer:
    """The recipe's Lightning Trainer writing under ``out`` (progress bar, logs and checkpoint IO
    included); ``callbacks`` go first. ``resume_step``: the step of the checkpoint a resumed run
    starts from (its logs continue the latest version, from that step); ``parent_folder``: the
    run folder of a checkpoint from elsewhere it starts from (its tracked runs are the parents)."""
    settings = recipe.trainer
    duration = settings.max_time_delta()
    timer = [InvocationTimer(duration)] if duration is not None else []
    # the recipe decides fp32 matmuls (Lightning's advice to set them is then noise, _Quiet)
    torch.set_float32_matmul_precision(matmul_precision(settings.matmul_precision, settings.precision))
    return L.Trainer(
        max_steps=settings.max_steps,
        max_epochs=-1,
        val_check_interval=settings.val_check_interval * settings.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=settings.limit_val_batches,
        num_sanity_val_steps=0,
        gradient_clip_val=settings.gradient_clip_val if settings.pipeline_parallel == 1 else None,  # the module clips
        accumulate_grad_batches=settings.accumulate_grad_batches,
        strategy=strategy_for(recipe),
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        logger=run_loggers(out, resume_step, settings.loggers, recipe.name or out.name, parent_folder),
        callbacks=[*callbacks, *timer, StepProgressBar(refresh_rate=settings.log_every_n_steps)],
        plugins=plugins_for(recipe),
        enable_checkpointing=False,
        enable_model_summary=False,
        # validation under no_grad, not inference_mode: FSDP2 unshards parameters during a
        # validation, and under inference_mode they come back as inference tensors, which the
        # next checkpoint's state dict cannot detach (every sharded CUDA run died at its end)
        inference_mode=False,
        use_distributed_sampler=False,
        log_every_n_steps=settings.log_every_n_steps,
        default_root_dir=out,
    )


def run_trainer(run: Run, callbacks: list, ckpt: Path | None, est=None) -> L.Trainer:
    """The trainer stage: :func:`make_trainer` for this run; a run resumed from ``ckpt`` continues
    its logs from that checkpoint's step (and its tracked runs; a checkpoint of another run
    folder makes them children of that folder's); the run folder gets ``config.yaml`` and the
    loggers the resolved recipe and the estimate ``est``."""
    step = int(peek_meta(ckpt).get("global_step") or 0) if ckpt is not None else None
    elsewhere = ckpt is not None and Path(ckpt).resolve().parent.parent != run.out.resolve()
    parent = Path(ckpt).resolve().parent.parent if elsewhere else None
    # a branch from another folder starts its own tracked runs (children), not this folder's
    trainer = make_trainer(run.recipe, run.out, callbacks, resume_step=step, parent_folder=parent)
    record(
        trainer,
        run.out,
        resolved_recipe(run),
        estimate_params(est) if est is not None else None,
    )
    return trainer


def fit(trainer: L.Trainer, module, data, ckpt: Path | None) -> None:
    """``trainer.fit``, resumed from ``ckpt`` when given (see :func:`resume_path`)."""
    if ckpt is not None:
        say(f"resuming from {ckpt}")
    wait_for_rank_zero(trainer)  # a bounded wait for rank 0's address, not torch's half hour
    trainer.fit(module, datamodule=data, ckpt_path=ckpt, weights_only=True)


def wrap_up(trainer: L.Trainer, module, data, throughput, checkpoints, out: Path, title: str, compiled=None) -> dict:
    """After ``fit``: a last validation unless the run ended on one, the summary, the loss curve.
    ``compiled``: the run's :class:`~yamlformer.recipes.parallel.compile.CompileClock`."""
    history = module.history
    if trainer.global_step and (not history["val"] or history["val"][-1][0] != trainer.global_step):
        trainer.validate(module, datamodule=data, verbose=False)
    summary = {
        "steps": trainer.global_step,
        "train_loss": history["train"][-1][1] if history["train"] else None,
        "val_loss": history["val"][-1][1] if history["val"] else None,
        "tokens_per_s": throughput.median_tokens_per_s(),
        "wall_seconds": module.wall_seconds(),
        "compile_seconds": compiled.seconds if compiled is not None else 0.0,
        "last": str(checkpoints.last_path),
        "best": str(checkpoints.best_path),
        "output_dir": str(out),
    }
    if trainer.is_global_zero:
        plot = plot_losses(history, out / "loss.png", title)
        val = f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "none"
        say(f"\n{stop_line(module.recipe.trainer, module.first_step, trainer.global_step)}")
        say(
            f"step {summary['steps']}: val loss {val}; checkpoints in {out / 'checkpoints'}"
            + (f"; loss curve {plot}" if plot else "")
        )
        if compiled is not None and compiled.count:
            say(
                f"compile: {compiled.seconds:.1f} s in {compiled.count} compilations (within the training time; "
                f"median throughput {summary['tokens_per_s'] or 0:,.0f} tokens/s leaves it out)"
            )
    return summary


def run(
    recipe_path: str | Path,
    overrides: dict[str, Any] | None = None,
    resume: str | bool | None = None,
    fresh: bool = False,
    samples: bool = True,
    verbose: bool = False,
    callbacks: list | None = None,
    stop: SignalStop | None = None,
) -> dict:
    """Train a recipe, of any task; returns a summary (steps, losses, paths). Raises on bad input
    or NaN, and :class:`yamlformer.recipes.training.signals.Stopped` when a signal stops it. ``verbose``: the
    full estimate tables before the first step, instead of one line; ``callbacks``: more Lightning
    callbacks (a benchmark's clock); ``stop``: the signals' handler ``builder train`` installed as
    it started (what it received since is acted on), else one installed now."""
    return train_recipe(load_recipe(recipe_path, overrides), resume, fresh, samples, verbose, callbacks, stop)


def train_recipe(
    located: LocatedRecipe,
    resume: str | bool | None = None,
    fresh: bool = False,
    samples: bool = True,
    verbose: bool = False,
    callbacks: list | None = None,
    stop: SignalStop | None = None,
) -> dict:
    """:func:`run` on a recipe already loaded (:func:`yamlformer.recipes.tasks.load_recipe`):
    resolved once (:func:`yamlformer.recipes.training.resolved.resolve_run`, the dry run's
    resolution and checks), then trained in its session, every stage reading the ``Run``."""
    resolved = resolve_run(located, fetch=True)
    if resolved.precision_note:
        say(resolved.precision_note)
    for line in resolved.recipe.schedule.warnings(resolved.recipe.trainer.max_steps):
        say(f"warning: {line}")
    check_devices(resolved.recipe)
    check_launcher(resolved.located)  # the nodes and processes torchrun or SLURM started
    check_clients(resolved.recipe.trainer.loggers, resolved.located.written)
    with run_session(resolved, fresh, resume, stop) as stop:
        return train(resolved, stop, resume, fresh, samples, callbacks, verbose)


@contextlib.contextmanager
def run_session(run: Run, fresh: bool, resume: str | bool | None = None, stop: SignalStop | None = None):
    """What a run holds from its first step to its last: signals caught (:mod:`yamlformer.recipes.training.signals`)
    and its folder checked writable and locked, its processes' meeting place
    (:func:`yamlformer.recipes.parallel.rendezvous.run_process_group`), earlier checkpoints set aside with ``fresh``
    (:func:`yamlformer.recipes.training.run_folder.claim`); a resume with a changed recipe or spec
    refused before any work (:func:`yamlformer.recipes.training.resume.check_recipe_early`).
    Yields the run's :class:`~yamlformer.recipes.training.signals.SignalStop`: ``stop`` (installed
    as ``builder train`` started, what it received kept) or a new one."""
    stop = stop or SignalStop()
    cache, settings = getattr(run.recipe.data, "cache_dir", None), run.recipe.trainer
    processes = run_process_group(settings.num_nodes, device_count(settings, check=False))
    with stop.installed(), claim(run.out, Path(cache) if cache else None, fresh=fresh, say=say), processes:
        check_recipe_early(run, resume, fresh)
        yield stop


def stop_callback(stop, checkpoints: RecipeCheckpoint):
    """The callback that saves ``last.ckpt`` and stops at a signal (and requeues a SLURM job after
    its warning, :mod:`yamlformer.recipes.training.requeue`); goes last in the list."""
    return StopOnSignal(stop, checkpoints.save_last, then=requeue)


def throughput_for(run: Run, prepared, flops_per_token: int):
    """The throughput callback: tokens per step from the batch shape, or counted per batch."""
    settings = run.recipe.trainer
    if prepared.tokens_of is None:
        tokens = prepared.batch * prepared.seq_len * settings.accumulate_grad_batches
        return Throughput(tokens, flops_per_token, settings.precision, settings.log_every_n_steps)
    return CountedThroughput(prepared.tokens_of, flops_per_token, settings.precision, settings.log_every_n_steps)


def train(
    run: Run,
    stop,
    resume: str | bool | None,
    fresh: bool,
    samples: bool,
    callbacks: list | None = None,
    verbose: bool = False,
) -> dict:
    """The run of :func:`run`, inside its session, stage by stage, each handed ``run`` and what
    the stage before it made: the task's data stage (:meth:`yamlformer.recipes.tasks.task.Task.prepare`:
    tokenizer and batches), the model, the Trainer (checkpoints, resuming, logs), the fit and the
    wrap-up, the same for every task."""
    settings = run.recipe.trainer
    quiet_lightning()
    say_devices(run)
    L.seed_everything(settings.seed, workers=True, verbose=False)
    prepared = run.task.prepare(run, samples)
    if prepared.tokenizer.vocab_size != run.spec.vocab_size:  # the resolution read it without the data work
        raise RecipeError(
            f"the tokenizer has {prepared.tokenizer.vocab_size:,} tokens, but the run was resolved with "
            f"{run.spec.vocab_size:,} ({run.vocab.how}); delete the cached tokenizer under {run.recipe.data.cache_dir}"
        )
    meta = training_meta(run, prepared.tokenizer, task=run.task.name, **prepared.meta)
    ckpt = resume_path(run.out, resume, fresh, meta)  # before the model: a run that cannot resume stops here
    model, est = training_model(run, prepared.init, prepared.seq_len, prepared.batch, verbose=verbose)
    module = prepared.module_class(model, run.recipe, meta)
    checkpoints = RecipeCheckpoint(run.checkpoints, settings.checkpoint_every_n_steps, settings.keep_every_n_steps)
    throughput = throughput_for(run, prepared, est.flops.train_per_token)
    extra = prepared.callbacks(run.checkpoints) if prepared.callbacks is not None else []
    stats = StepStats(settings.log_every_n_steps)  # lr and peak memory beside the throughput
    shared = SharedRunFolder(run.out)  # every node sees the run folder, checked as the ranks meet
    own = [shared, checkpoints, throughput, stats, *extra, *(callbacks or []), stop_callback(stop, checkpoints)]
    trainer = run_trainer(run, own, ckpt, est)
    try:
        with compiling(run.out) as compiled:
            fit(trainer, module, prepared.data, ckpt)
        return _finish(run, trainer, module, prepared, throughput, checkpoints, compiled)
    finally:
        close_trackers(trainer)


def _finish(run: Run, trainer, module, prepared, throughput, checkpoints, compiled) -> dict:
    """After the fit: the wrap-up and what the task runs after training."""
    with eager():
        summary = wrap_up(trainer, module, prepared.data, throughput, checkpoints, run.out, run.title, compiled)
        summary.update(task=run.task.name, val_metrics=dict(getattr(module, "val_metrics", {})))
        if prepared.finish is not None:
            model = whole_model(module)  # every rank: a sharded model is gathered to rank 0
            if trainer.is_global_zero:
                summary.update(prepared.finish(module, model, run.checkpoints))
    return summary
