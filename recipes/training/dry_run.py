"""``builder train RECIPE --dry-run``: what a run would use, resolved, and nothing run.

It resolves the recipe as the run does, with the run's checks
(:func:`yamlformer.recipes.training.resolved.resolve_run`: every default filled in, ``--set``
applied, each data file present under the data root or the URL it would be downloaded from, the
tokenizer's vocabulary, the model spec with its overrides and that vocabulary, the data's
windows where its tokens are known) and whether the run may resume the checkpoint it would start
from; then prints the resolved recipe, the devices, strategy and precision, and the estimate
table at the recipe's batch shape. Nothing is downloaded, trained or written; torch is imported
only to see which accelerators this machine has (and the precision settings, Lightning's).
:func:`recipe_estimate` serves the start of every run and a study's variants too.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from yamlformer.builder.analysis.estimates import Step, estimate
from yamlformer.builder.analysis.layout import Layout
from yamlformer.builder.analysis.layout_memory import layout_memory
from yamlformer.builder.analysis.report import human, human_bytes, print_describe
from yamlformer.builder.hf import export_line
from yamlformer.builder.zoo import shown
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import Recipe, spec_file
from yamlformer.recipes.recipe.sections import recipe_path as locate_recipe
from yamlformer.recipes.tasks import load_recipe
from yamlformer.recipes.tasks.files import DataFile
from yamlformer.recipes.training.resolved import resolve_run
from yamlformer.recipes.training.resume import check_recipe_early

# -- devices -----------------------------------------------------------------------------------------


def devices_line(recipe: Recipe, precision_note: str | None = None, precision: str | None = None) -> str:
    """Accelerator, devices, strategy and precision as this machine would run them, the devices
    counted as training counts them (:func:`yamlformer.recipes.parallel.mesh.device_count`), and a warning
    when train would refuse them here (a launch line meant for another machine still shows).
    ``precision``: the precision a run resolved (else resolved here), ``precision_note``: why
    ``trainer.precision: auto`` chose what it did."""
    # local: the parallel package and precision import torch and Lightning; a study estimates with this module without
    from yamlformer.recipes.parallel.compile import compile_mode
    from yamlformer.recipes.parallel.mesh import device_count, layout_of
    from yamlformer.recipes.training.precision import resolve_precision

    settings = recipe.trainer
    accelerator, count = _accelerator(settings)
    total = count * settings.num_nodes
    strategy = settings.strategy
    if strategy == "auto":
        strategy = "auto: one device" if total == 1 else f"auto: DDP over {total} processes"
    parts = [
        f"{accelerator} x {count}" + (f" on each of {settings.num_nodes} nodes" if settings.num_nodes > 1 else ""),
        f"strategy {strategy}",
    ]
    for field in ("tensor_parallel", "context_parallel", "data_parallel"):  # when the recipe's trainer has them
        value = getattr(settings, field, None)
        if value is not None and settings.strategy == "fsdp" and (field != "context_parallel" or value > 1):
            parts.append(f"{field} {value}")
    if settings.strategy == "fsdp" and getattr(settings, "expert_parallel", 1) > 1:
        parts.append(f"expert_parallel {settings.expert_parallel}")
    if settings.pipeline_parallel > 1:
        parts.append(
            f"pipeline_parallel {settings.pipeline_parallel} ({settings.pipeline_schedule}, "
            f"{settings.pipeline_microbatches()} micro-batches)"
        )
    chosen, note = (precision, None) if precision else resolve_precision(settings.precision, settings.accelerator)
    note = note or precision_note
    parts.append(f"precision {chosen}" + (f" ({note})" if note else ""))
    if settings.activation_checkpointing:
        parts.append("activation checkpointing")
    if settings.compile:
        parts.append(f"torch.compile ({compile_mode(settings)})")
    try:
        (layout_of if settings.strategy == "fsdp" else device_count)(settings)
    except RecipeError as exc:
        parts.append(f"WARNING: {exc}; train refuses this on this machine")
    return ", ".join(parts)


def _accelerator(settings) -> tuple[str, int]:
    """What Lightning's ``auto`` picks here, and the devices per node as training counts them,
    not checked against this machine (:func:`devices_line` says what train would refuse)."""
    # local: the parallel package and precision import torch and Lightning; a study estimates with this module without
    from yamlformer.recipes.parallel.mesh import accelerator_of, device_count

    return accelerator_of(settings.accelerator), device_count(settings, check=False)


# -- the estimate ------------------------------------------------------------------------------------


def run_estimate(run, devices: int | None = None):
    """The estimate of a resolved ``Run`` (:func:`recipe_estimate` at its micro-batch, its
    precision and its reference copy, if any)."""
    return recipe_estimate(run.spec, run.recipe, run.seq_len, run.batch, devices, run.precision, run.reference)


def recipe_estimate(
    spec,
    recipe: Recipe,
    seq_len: int,
    batch: int,
    devices: int | None = None,
    precision: str | None = None,
    reference: bool = False,
):
    """The spec's estimate under the recipe's trainer settings (precision as this machine runs
    it, devices, strategy and its layout, checkpointing), at ``seq_len`` tokens x ``batch``
    sequences per device; ``reference``: a frozen copy of the model beside it (what the task's
    resolution says, :meth:`yamlformer.recipes.tasks.task.Resolution.reference_copy`).
    ``devices``: per node (default: what ``trainer.devices`` asks for, as
    :func:`yamlformer.recipes.parallel.mesh.device_count` counts it; a run passes what the machine gives it);
    ``precision``: the one a run resolved (default: ``trainer.precision`` resolved here)."""
    # local: the parallel package and precision import torch and Lightning; a study estimates with this module without
    from yamlformer.recipes.parallel.mesh import device_count
    from yamlformer.recipes.training.precision import estimate_dtype, resolve_precision

    settings = recipe.trainer
    if precision is None:
        precision, _ = resolve_precision(settings.precision, settings.accelerator)  # auto: what this machine runs
    dtype = estimate_dtype(precision)
    if devices is None:
        devices = device_count(settings, check=False)
    sharded = settings.strategy == "fsdp"
    # a context-parallel rank holds seq_len / C tokens of each row; its FSDP shard group is the same
    # ranks as data-parallel ones would be (the gathered keys and values are not counted)
    shares = getattr(settings, "context_parallel", 1) if sharded else 1
    step = Step(
        seq_len=seq_len // shares,
        batch=batch,
        dtype=dtype,
        activation_checkpointing=settings.activation_checkpointing,
        optimizer=recipe.optimizer,
        reference=reference,
    )
    layout = Layout(
        devices=devices * settings.num_nodes,
        nodes=settings.num_nodes,
        tensor_parallel=settings.tensor_parallel if sharded else 1,
        data_parallel=settings.data_parallel,
        strategy="fsdp" if sharded else "ddp",
    )
    return estimate(spec, step, layout)


def layout_memory_line(run) -> str | None:
    """Per device under the pipeline, context or expert parallelism of ``run`` (its spec, recipe,
    resolved precision and micro-batch), as ``builder describe`` counts that layout (the stage
    holding the most, each stage's states exact); None for a layout without them (the estimate's
    tables count it)."""
    # local: the parallel package and precision import torch and Lightning; a study estimates with this module without
    from yamlformer.recipes.parallel.mesh import device_count, layout_of
    from yamlformer.recipes.training.precision import estimate_dtype

    spec, recipe, seq_len, batch = run.spec, run.recipe, run.seq_len, run.batch
    settings = recipe.trainer
    if settings.strategy != "fsdp":
        return None
    layout = layout_of(settings, device_count(settings, check=False))
    micro = settings.pipeline_microbatches() if settings.pipeline_parallel > 1 else 1
    counted = layout_memory(
        spec,
        layout,
        seq_len=seq_len,
        micro_batch=max(1, batch // micro),
        dtype=estimate_dtype(run.precision),
        checkpointing=settings.activation_checkpointing,
        schedule=settings.pipeline_schedule,
        microbatches=micro,
        optimizer=recipe.optimizer,
    )
    if counted is None:
        return None
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in counted["parts"].items())
    return (
        f"{human_bytes(counted['per_gpu_bytes'])} per device on {layout.describe()} ({parts}; builder describe's "
        "count of this layout); the tables below are the layout without pipeline, context or expert parallelism"
    )


# -- the command -------------------------------------------------------------------------------------


def dry_run(
    recipe_path: str | Path,
    overrides: dict[str, Any] | None = None,
    out=None,
    resume: str | bool | None = None,
    fresh: bool = False,
) -> dict:
    """Resolve and print everything ``builder train`` would use, through the run's own resolution
    and checks (:func:`yamlformer.recipes.training.resolved.resolve_run`, and whether it may resume
    its checkpoint); returns it as plain data."""
    out = out or sys.stdout
    run = resolve_run(load_recipe(locate_recipe(recipe_path), overrides))
    resumes = check_recipe_early(run, resume, fresh)
    recipe, spec, files = run.recipe, run.spec, run.files
    est = run_estimate(run)

    resolved = recipe.model_dump(mode="json")
    print(f"# {shown(run.file)}, resolved (defaults filled in, --set applied); nothing is run", file=out)
    print(yaml.safe_dump(resolved, sort_keys=False, width=100).rstrip(), file=out)
    print(file=out)
    lines = [
        (
            "model",
            f"{spec.name} ({_spec_source(run)}), {spec.architecture}, {est.params.total:,} parameters "
            f"({human(est.params.total)}); vocab_size {spec.vocab_size:,} from the tokenizer",
        )
    ]
    if recipe.model.overrides:
        lines.append(("overrides", ", ".join(f"{k}={v}" for k, v in recipe.model.overrides.items())))
    lines.append(("tokenizer", run.vocab.how))
    lines += [("data", _data_line(f)) for f in files]
    lines += run.resolution.dry_run_lines
    lines.append(("devices", devices_line(recipe, run.precision_note, run.precision)))
    staged = layout_memory_line(run)
    if staged:
        lines.append(("memory", staged))
    lines.append(("export", export_line(spec)))
    settings = recipe.trainer
    lines.append(
        (
            "batch",
            f"{run.shape} per device; x {settings.accumulate_grad_batches} accumulation; "
            f"{settings.max_steps:,} steps" + (f" or {settings.max_time}" if settings.max_time else ""),
        )
    )
    lines.append(("output", f"{run.out} ({'resumes from ' + str(resumes) if resumes else 'a new run'})"))
    lines += [("warning", line) for line in recipe.schedule.warnings(settings.max_steps)]
    width = max(len(k) for k, _ in lines)
    for key, text in lines:
        print(f"{key:<{width}}  {text}", file=out)
    to_fetch = [f for f in files if not f.present and f.url]
    if to_fetch:
        size = sum(f.size or 0 for f in to_fetch)
        print(
            f"\nwould download {len(to_fetch)} file{'s' * (len(to_fetch) != 1)} ({size / 1e6:.1f} MB) on the first "
            "run; offline, point BUILDER_DATA (or data.root) at a folder holding them",
            file=out,
        )
    print(file=out)
    print_describe(spec, est, console=Console(file=out) if out is not sys.stdout else None)
    return {
        "recipe": resolved,
        "spec": spec.model_dump(mode="json"),
        "vocab_size": run.vocab.size,
        "data": [dataclasses.asdict(f) | {"path": str(f.path) if f.path else None} for f in files],
        "params": est.params.total,
        "output_dir": str(run.out),
        "resumes": str(resumes) if resumes else None,
    }


def _spec_source(run) -> str:
    """Where the run's spec was written: inline, a file or zoo name, or the ``model.init_from`` it was trained with."""
    spec = run.recipe.model.spec
    if isinstance(spec, dict):
        return "inline spec"
    if spec is None:
        return f"{run.recipe.model.init_from}'s spec"
    return f"{shown(spec_file(run.located))} spec"


def data_parallel_ranks(recipe: Recipe) -> int:
    """Ranks that read different data in the recipe's layout, as training counts them
    (:func:`yamlformer.recipes.parallel.mesh.data_parallel_ranks`), devices not checked against this machine."""
    # local: the parallel package imports torch; a study's estimates ask this without it
    from yamlformer.recipes.parallel import mesh

    return mesh.data_parallel_ranks(recipe.trainer, check=False)


def _data_line(f: DataFile) -> str:
    if f.path is None:
        return f"{f.what}: files of this machine, nothing downloaded"
    if f.present:
        return f"{f.what}: {f.path} (on disk)"
    if f.url:
        terms = f"; terms: {f.terms}" if f.terms else ""
        return f"{f.what}: would download {f.url} ({f.size / 1e6:.1f} MB) to {f.path}{terms}"
    return f"{f.what}: {f.path} (MISSING)"
