"""``builder train RECIPE --dry-run``: what a run would use, resolved, and nothing run.

It resolves the recipe (every default filled in, ``--set`` applied), the data (each file present
under the data root, or the URL it would be downloaded from and its terms), the tokenizer's
vocabulary (stated, read from a model file or a checkpoint, or counted from a corpus already on
disk — a sentencepiece model is never trained here), the model spec with its overrides and that
vocabulary (validated), and the devices, strategy and precision; then prints the resolved recipe
and the estimate table at the recipe's batch shape. Nothing is downloaded, trained or written;
torch is imported only to see which accelerators this machine has. Torch-free otherwise:
:func:`vocabulary` and :func:`recipe_estimate` serve ``builder validate``, ``builder list`` and
the start of every run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.fields import resolve
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.task import DataFile, Vocabulary

#: the vocabulary a char tokenizer is estimated with before its corpus is read (bytes)
CHAR_STAND_IN = 256


def vocabulary(recipe: Recipe, recipe_file: Path, read_data: bool = True) -> Vocabulary:
    """The tokenizer's vocabulary size without training one: the task's when it knows it (a
    tokenized dataset's, a pretrained checkpoint's), else from the tokenizer settings. ``read_data``:
    a char tokenizer counts the characters of its corpus when every file is on disk (else a
    stand-in), and a pretrained checkpoint is read for its tokenizer."""
    from yamlformer.recipes.tasks import task_named

    known = task_named(recipe.task).vocabulary(recipe, recipe_file, read_data)
    if known is not None:
        return known
    if recipe.model.init_from is not None:  # its tokenizer is the run's (yamlformer.recipes.training.pretrained)
        inherited = _init_from_vocabulary(recipe, recipe_file, read_data)
        if inherited is not None:
            return inherited
    settings = recipe.tokenizer
    if settings.type == "hf" or (settings.type == "sentencepiece" and settings.model_file is not None):
        from yamlformer.recipes.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(settings, "", "", Path(recipe.data.cache_dir), recipe_file)
        return Vocabulary(tokenizer.vocab_size, f"{settings.type} tokenizer from {settings.model_file}")
    if settings.type == "char":
        missing = [f for f in data_files(recipe, recipe_file) if not f.present]
        if read_data and not missing:
            from yamlformer.recipes.data.corpus import read_corpus
            from yamlformer.recipes.data.tokenizers import CharTokenizer

            size = CharTokenizer.fit(read_corpus(recipe.data, recipe_file).text, eos=True).vocab_size
            return Vocabulary(size, f"char: the corpus's {size - 1} distinct characters and end-of-text")
        why = "its corpus is not downloaded yet" if missing else "the corpus is not read here"
        return Vocabulary(
            CHAR_STAND_IN, f"char: the corpus's distinct characters ({why}; estimated with {CHAR_STAND_IN})", True
        )
    return Vocabulary(
        settings.vocab_size,
        f"sentencepiece {settings.model_type}, {settings.vocab_size:,} pieces "
        f"trained on the corpus at the first run (cached under {recipe.data.cache_dir})",
    )


def _init_from_vocabulary(recipe: Recipe, recipe_file: Path, read_data: bool) -> Vocabulary | None:
    """The vocabulary of ``model.init_from``'s tokenizer: a recipe not trained yet, its own; a run's
    checkpoint, its tokenizer's (read with ``read_data``); None for a source without one."""
    from yamlformer.recipes.recipe.sections import load_recipe
    from yamlformer.recipes.training.pretrained import pretrained_tokenizer, recipe_run

    run = recipe_run(recipe, recipe_file)
    if run is not None and not run[1].exists():
        other = vocabulary(load_recipe(run[0]), run[0], read_data)
        return dataclasses.replace(
            other, how=f"{other.how} (model.init_from {recipe.model.init_from}, not trained yet)"
        )
    if not read_data:
        return None
    tokenizer = pretrained_tokenizer(recipe, recipe_file)
    if tokenizer is None:
        return None
    return Vocabulary(tokenizer.vocab_size, f"the tokenizer of model.init_from {recipe.model.init_from}")


# -- data --------------------------------------------------------------------------------------------


class DataFiles:
    """The files a recipe reads, collected in order as its task names them
    (:meth:`yamlformer.recipes.tasks.task.Task.data_files`): a dataset's splits (on disk under the data root, or
    the URL they would come from) and the recipe's own files."""

    def __init__(self, recipe: Recipe, recipe_file: Path):
        from yamlformer.recipes.data import registry

        self.recipe, self.recipe_file, self.found = recipe, recipe_file, []
        self._datasets = registry
        data = recipe.data
        names = [getattr(s, "path", s) for s in getattr(data, "sources", [])]
        uses = data.dataset is not None or any(name in registry.DATASETS for name in names)
        self._root = registry.data_root(data.dataset_root(recipe_file)) if uses else None

    def is_dataset(self, name: str) -> bool:
        return name in self._datasets.DATASETS

    def registry(self, name: str):
        """The registry's :class:`yamlformer.recipes.data.registry.Dataset` called ``name``."""
        return self._datasets.get(name)

    def add(self, what: str, path: Path | None, present: bool, **where) -> None:
        self.found.append(DataFile(what, path, present, **where))

    def dataset(self, name: str, splits: list[str]) -> None:
        """The files of dataset ``name``'s ``splits``."""
        spec = self._datasets.get(name)
        if spec.local is not None:
            self.add(name, None, True, terms=spec.license)
            return
        base = self._root or self._datasets.data_root(self.recipe.data.dataset_root(self.recipe_file))
        for split in splits:
            for path in spec.splits[split].values():
                remote = spec.file(path)
                where = base.joinpath(*remote.path.split("/"))
                terms = spec.license if spec.restricted else None
                self.add(f"{name} {split}", where, where.is_file(), url=remote.url, size=remote.size, terms=terms)

    def own(self, what: str, path: str | None) -> None:
        """A file the recipe names (``None``: not set)."""
        if path is not None:
            where = resolve(self.recipe_file, path)
            self.add(what, where, where.exists())


def data_files(recipe: Recipe, recipe_file: Path) -> list[DataFile]:
    """Every file the recipe's data section reads, in order; nothing is fetched or read."""
    from yamlformer.recipes.tasks import task_named

    files = DataFiles(recipe, recipe_file)
    task_named(recipe.task).data_files(recipe, recipe_file, files)
    return files.found


def _close_names(path: Path) -> str:
    """``; did you mean 'x'?`` for entries of ``path``'s folder whose names are close to its own."""
    import difflib

    try:
        names = [entry.name for entry in path.parent.iterdir()] if path.parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.6)
    return "; did you mean " + " or ".join(repr(str(path.parent / c)) for c in close) + "?" if close else ""


def missing_inputs(recipe: Recipe, recipe_file: Path, files: list[DataFile] | None = None) -> list[str]:
    """One line per file the recipe names that is not there and will not be downloaded: its field,
    the path it was looked for at (relative paths: from the recipe's folder) and close names
    beside it. Data files a dataset downloads on the first run are not missing; ``files``: the
    recipe's :func:`data_files`, when the caller has them. (A missing ``tokenizer.model_file`` is
    refused when the recipe loads.)"""
    files = data_files(recipe, recipe_file) if files is None else files
    lines = [
        f"{f.what}: no such file or folder {f.path}{_close_names(f.path)}"
        for f in files
        if f.path is not None and not f.present and not f.url
    ]
    named = [
        ("model.init_from", recipe.model.init_from),
        ("classification.init_from", getattr(getattr(recipe, "classification", None), "init_from", None)),
    ]
    for field, value in named:
        if value is not None:
            if field == "model.init_from":  # a path, or a recipe (its run trained before this one: not missing)
                from yamlformer.recipes.training.pretrained import recipe_run

                if recipe_run(recipe, recipe_file) is not None:
                    continue
            path = resolve(recipe_file, value)
            if not path.exists():
                lines.append(f"{field}: no such file or folder {path}{_close_names(path)}")
    return lines


# -- devices -----------------------------------------------------------------------------------------


def devices_line(recipe: Recipe) -> str:
    """Accelerator, devices, strategy and precision as this machine would run them, the devices
    counted as training counts them (:func:`yamlformer.recipes.parallel.mesh.device_count`), and a warning
    when train would refuse them here (a launch line meant for another machine still shows)."""
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
    chosen, note = resolve_precision(settings.precision, settings.accelerator)
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
    from yamlformer.recipes.parallel.mesh import accelerator_of, device_count

    return accelerator_of(settings.accelerator), device_count(settings, check=False)


# -- the estimate ------------------------------------------------------------------------------------


def batch_shape(recipe: Recipe, spec) -> tuple[int, int, str]:
    """``(seq_len, batch, how)``: the micro-batch shape the estimate is made at (the task's)."""
    from yamlformer.recipes.tasks import task_named

    return task_named(recipe.task).batch_shape(recipe, spec)


def recipe_estimate(spec, recipe: Recipe, seq_len: int, batch: int, devices: int | None = None):
    """The spec's estimate under the recipe's trainer settings (precision as this machine runs
    it, devices, strategy and its layout, checkpointing), at ``seq_len`` tokens x ``batch``
    sequences per device.
    ``devices``: per node (default: what ``trainer.devices`` asks for, as
    :func:`yamlformer.recipes.parallel.mesh.device_count` counts it; a run passes what the machine gives it)."""
    from yamlformer.builder.analysis.estimates import Step, estimate
    from yamlformer.builder.analysis.layout import Layout
    from yamlformer.recipes.parallel.mesh import device_count
    from yamlformer.recipes.training.precision import estimate_dtype, resolve_precision

    settings = recipe.trainer
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
    )
    layout = Layout(
        devices=devices * settings.num_nodes,
        nodes=settings.num_nodes,
        tensor_parallel=settings.tensor_parallel if sharded else 1,
        data_parallel=settings.data_parallel,
        strategy="fsdp" if sharded else "ddp",
    )
    return estimate(spec, step, layout)


def layout_memory_line(spec, recipe: Recipe, seq_len: int, batch: int) -> str | None:
    """Per device under the recipe's pipeline, context or expert parallelism, as ``builder
    describe`` counts that layout (the stage holding the most, each stage's states exact); None
    for a layout without them (the estimate's tables count it)."""
    from yamlformer.builder.analysis.layout_memory import layout_memory
    from yamlformer.builder.analysis.report import human_bytes
    from yamlformer.recipes.parallel.mesh import device_count, layout_of
    from yamlformer.recipes.training.precision import estimate_dtype, resolve_precision

    settings = recipe.trainer
    if settings.strategy != "fsdp":
        return None
    precision, _ = resolve_precision(settings.precision, settings.accelerator)
    layout = layout_of(settings, device_count(settings, check=False))
    micro = settings.pipeline_microbatches() if settings.pipeline_parallel > 1 else 1
    counted = layout_memory(
        spec,
        layout,
        seq_len=seq_len,
        micro_batch=max(1, batch // micro),
        dtype=estimate_dtype(precision),
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


def dry_run(recipe_path: str | Path, overrides: dict[str, Any] | None = None, out=None) -> dict:
    """Resolve and print everything ``builder train`` would use; returns it as plain data."""
    import sys

    import yaml
    from rich.console import Console

    from yamlformer.builder.analysis.report import human, print_describe
    from yamlformer.builder.zoo import shown
    from yamlformer.recipes.recipe.sections import load_recipe, model_spec, output_dir, spec_file
    from yamlformer.recipes.recipe.sections import recipe_path as locate_recipe
    from yamlformer.recipes.tasks import task_named

    out = out or sys.stdout
    recipe_file = locate_recipe(recipe_path)
    recipe = load_recipe(recipe_file, overrides)
    files = data_files(recipe, recipe_file)
    missing = missing_inputs(recipe, recipe_file, files)
    if missing:
        raise RecipeError("; ".join(missing))
    task = task_named(recipe.task)
    vocab = vocabulary(recipe, recipe_file)
    spec = model_spec(recipe, recipe_file, vocab.size)
    seq_len, batch, shape = batch_shape(recipe, spec)
    task.check_spec(recipe, spec)
    est = recipe_estimate(spec, recipe, seq_len, batch)
    run_dir = output_dir(recipe, recipe_file)
    last = run_dir / "checkpoints" / "last.ckpt"

    resolved = recipe.model_dump(mode="json")
    if recipe.model.spec is None:  # the spec model.init_from's weights carry
        where = f"{recipe.model.init_from}'s"
    else:
        where = "inline" if isinstance(recipe.model.spec, dict) else shown(spec_file(recipe, recipe_file))
    print(f"# {shown(recipe_file)}, resolved (defaults filled in, --set applied); nothing is run", file=out)
    print(yaml.safe_dump(resolved, sort_keys=False, width=100).rstrip(), file=out)
    print(file=out)
    lines = [
        (
            "model",
            f"{spec.name} ({where} spec), {spec.architecture}, {est.params.total:,} parameters "
            f"({human(est.params.total)}); vocab_size {spec.vocab_size:,} from the tokenizer",
        )
    ]
    if recipe.model.overrides:
        lines.append(("overrides", ", ".join(f"{k}={v}" for k, v in recipe.model.overrides.items())))
    lines.append(("tokenizer", vocab.how))
    lines += [("data", _data_line(f)) for f in files]
    lines += task.dry_run_lines(recipe, recipe_file)
    lines.append(("devices", devices_line(recipe)))
    staged = layout_memory_line(spec, recipe, seq_len, batch)
    if staged:
        lines.append(("memory", staged))
    from yamlformer.builder.hf import export_line

    lines.append(("export", export_line(spec)))
    settings = recipe.trainer
    lines.append(
        (
            "batch",
            f"{shape} per device; x {settings.accumulate_grad_batches} accumulation; "
            f"{settings.max_steps:,} steps" + (f" or {settings.max_time}" if settings.max_time else ""),
        )
    )
    lines.append(("output", f"{run_dir} ({'resumes from ' + str(last) if last.is_file() else 'a new run'})"))
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
    missing = [f for f in files if not f.present and not f.url]
    for f in missing:
        print(f"missing: {f.what} {f.path}", file=out)
    print(file=out)
    print_describe(spec, est, console=Console(file=out) if out is not sys.stdout else None)
    return {
        "recipe": resolved,
        "spec": spec.model_dump(mode="json"),
        "vocab_size": vocab.size,
        "data": [dataclasses.asdict(f) | {"path": str(f.path) if f.path else None} for f in files],
        "params": est.params.total,
        "output_dir": str(run_dir),
        "missing": [str(f.path) for f in missing],
    }


def data_parallel_ranks(recipe: Recipe) -> int:
    """Ranks that read different data in the recipe's layout, as training counts them
    (:func:`yamlformer.recipes.parallel.mesh.data_parallel_ranks`), devices not checked against this machine."""
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
