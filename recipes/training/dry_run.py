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

from recipes.recipe.sections import Recipe, RecipeError, SourceEntry, resolve

#: the vocabulary a char tokenizer is estimated with before its corpus is read (bytes)
CHAR_STAND_IN = 256


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The vocabulary a run's tokenizer will have: ``size`` and how it is known."""

    size: int
    how: str
    stand_in: bool = False  # the size is a stand-in until the data is read


def vocabulary(recipe: Recipe, recipe_file: Path, read_data: bool = True) -> Vocabulary:
    """The tokenizer's vocabulary size without training one. ``read_data``: a char tokenizer
    counts the characters of its corpus when every file is on disk (else a stand-in), and
    ``classification.init_from`` is read for its tokenizer."""
    settings = recipe.tokenizer
    if recipe.task in ("lm", "mlm"):
        from recipes.data.corpus import kind_of
        from recipes.data.tokenized import TokenizedDataset

        for entry in recipe.data.entries():
            kind, path = kind_of(entry, recipe.data, recipe_file)
            if kind == "tokenized":  # its tokenizer is the run's (recipes.data.corpus)
                dataset = TokenizedDataset.open(path)
                kind = dataset.manifest["tokenizer"]["kind"]
                return Vocabulary(
                    dataset.vocab_size, f"{kind} from the tokenized dataset {path} (the one it was made with)"
                )
    init_from = getattr(getattr(recipe, "classification", None), "init_from", None)
    if init_from is not None:
        path = resolve(recipe_file, init_from)
        if read_data and path.is_file():
            return Vocabulary(_checkpoint_vocabulary(path), f"the tokenizer of classification.init_from {path}")
        return Vocabulary(
            settings.vocab_size,
            f"the tokenizer of classification.init_from {path} "
            f"(not read here; estimated with tokenizer.vocab_size {settings.vocab_size:,})",
            True,
        )
    if settings.type == "hf" or (settings.type == "sentencepiece" and settings.model_file is not None):
        from recipes.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(settings, "", "", Path(recipe.data.cache_dir), recipe_file)
        return Vocabulary(tokenizer.vocab_size, f"{settings.type} tokenizer from {settings.model_file}")
    if settings.type == "char":
        missing = [f for f in data_files(recipe, recipe_file) if not f.present]
        if read_data and not missing:
            from recipes.data.corpus import read_corpus

            chars = len(set(read_corpus(recipe.data, recipe_file).text))
            return Vocabulary(chars, f"char: the {chars} distinct characters of the corpus")
        why = "its corpus is not downloaded yet" if missing else "the corpus is not read here"
        return Vocabulary(
            CHAR_STAND_IN, f"char: the corpus's distinct characters ({why}; estimated with {CHAR_STAND_IN})", True
        )
    return Vocabulary(
        settings.vocab_size,
        f"sentencepiece {settings.model_type}, {settings.vocab_size:,} pieces "
        f"trained on the corpus at the first run (cached under {recipe.data.cache_dir})",
    )


def _checkpoint_vocabulary(path: Path) -> int:
    import torch

    from recipes.data.tokenizers import from_state

    meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("builder")
    if meta is None:
        raise RecipeError(f"classification.init_from: {path} was not written by `builder train`")
    return from_state(meta["tokenizer"]).vocab_size


# -- data --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One file a run reads: where, whether it is there, and where it would come from."""

    what: str  # "tinyshakespeare", "data.train.source"
    path: Path | None  # None: the files of this machine (python-stdlib)
    present: bool
    url: str | None = None
    size: int | None = None
    terms: str | None = None


def data_files(recipe: Recipe, recipe_file: Path) -> list[DataFile]:
    """Every file the recipe's data section reads, in order; nothing is fetched or read."""
    from recipes.data import registry as datasets

    data = recipe.data
    found: list[DataFile] = []
    root = (
        datasets.data_root(data.dataset_root(recipe_file))
        if data.dataset is not None
        or any(getattr(s, "path", s) in datasets.DATASETS for s in getattr(data, "sources", []))
        else None
    )

    def dataset(name: str, splits: list[str]) -> None:
        spec = datasets.get(name)
        if spec.local is not None:
            found.append(DataFile(name, None, True, terms=spec.license))
            return
        base = datasets.data_root(data.dataset_root(recipe_file)) if root is None else root
        for split in splits:
            for path in spec.splits[split].values():
                remote = spec.file(path)
                where = base.joinpath(*remote.path.split("/"))
                found.append(
                    DataFile(
                        f"{name} {split}",
                        where,
                        where.is_file(),
                        remote.url,
                        remote.size,
                        spec.license if spec.restricted else None,
                    )
                )

    def own(what: str, path: str | None) -> None:
        if path is not None:
            where = resolve(recipe_file, path)
            found.append(DataFile(what, where, where.exists()))

    if recipe.task in ("lm", "mlm"):
        from recipes.data.corpus import kind_of

        for entry in data.entries():
            if entry.path in datasets.DATASETS:
                dataset(entry.path, [datasets.get(entry.path).train] if datasets.get(entry.path).splits else [])
                continue
            kind, where = kind_of(entry, data, recipe_file)
            found.append(
                DataFile(
                    "data.sources" if kind == "text" else f"data.sources ({kind})",
                    where,
                    kind != "text" or where.exists(),
                )
            )
            if entry.validation is not None:
                held = SourceEntry(path=entry.validation, dtype=entry.dtype)
                kind, where = kind_of(held, data, recipe_file)
                found.append(DataFile("data.sources.validation", where, kind != "text" or where.exists()))
    elif recipe.task == "translation":
        for role in ("train", "validation"):
            files = getattr(data, role)
            if files is not None:
                own(f"data.{role}.source", files.source)
                own(f"data.{role}.target", files.target)
            elif data.dataset is not None:
                spec = datasets.get(data.dataset)
                dataset(data.dataset, [spec.split_of(role)])
    elif recipe.task == "classification":
        if data.dataset is not None:
            dataset(data.dataset, [data.split or datasets.get(data.dataset).train])
        own("data.file", data.file)
        for label, path in (data.by_label or {}).items():
            own(f"data.by_label.{label}", path)
        own("data.validation", data.validation)
    return found


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
            path = resolve(recipe_file, value)
            if not path.exists():
                lines.append(f"{field}: no such file or folder {path}{_close_names(path)}")
    return lines


# -- devices -----------------------------------------------------------------------------------------


def devices_line(recipe: Recipe) -> str:
    """Accelerator, devices, strategy and precision as this machine would run them."""
    settings = recipe.trainer
    accelerator, count = _accelerator(settings.accelerator, settings.devices)
    total = count * settings.num_nodes
    strategy = settings.strategy
    if strategy == "auto":
        strategy = "auto: one device" if total == 1 else f"auto: DDP over {total} processes"
    parts = [
        f"{accelerator} x {count}" + (f" on each of {settings.num_nodes} nodes" if settings.num_nodes > 1 else ""),
        f"strategy {strategy}",
    ]
    for field in ("tensor_parallel", "data_parallel"):  # when the recipe's trainer has them
        value = getattr(settings, field, None)
        if value is not None and settings.strategy == "fsdp":
            parts.append(f"{field} {value}")
    from recipes.training.precision import resolve_precision

    chosen, note = resolve_precision(settings.precision, settings.accelerator)
    parts.append(f"precision {chosen}" + (f" ({note})" if note else ""))
    if settings.activation_checkpointing:
        parts.append("activation checkpointing")
    if settings.compile:
        parts.append("torch.compile")
    return ", ".join(parts)


def _accelerator(accelerator: str, devices: int | str) -> tuple[str, int]:
    """What Lightning's ``auto`` picks here, and the devices per node."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if accelerator == "auto":
        accelerator = "cuda" if cuda else "mps" if mps else "cpu"
    elif accelerator == "gpu":
        accelerator = "cuda" if cuda or not mps else "mps"
    available = cuda if accelerator == "cuda" else 1
    if devices == "auto" or devices == -1 or devices == "-1":
        return accelerator, max(1, available) if accelerator == "cuda" else 1
    if isinstance(devices, str):
        listed = [d for d in devices.replace(" ", "").strip("[]").split(",") if d]
        return accelerator, len(listed) if len(listed) > 1 else int(listed[0]) if listed and listed[0].isdigit() else 1
    return accelerator, devices


# -- the estimate ------------------------------------------------------------------------------------


def batch_shape(recipe: Recipe, spec) -> tuple[int, int, str]:
    """``(seq_len, batch, how)``: the micro-batch shape the estimate is made at."""
    data = recipe.data
    if recipe.task in ("lm", "mlm"):
        return data.seq_len, data.batch_size, f"{data.batch_size} windows x {data.seq_len} tokens"
    longest = min(data.max_len, spec.max_seq_len)
    batch = max(1, data.max_tokens // longest)
    return (
        longest,
        batch,
        (
            f"the longest batch of data.max_tokens {data.max_tokens:,}: {batch} examples x "
            f"{longest} tokens (data.max_len)"
        ),
    )


def recipe_estimate(spec, recipe: Recipe, seq_len: int, batch: int, devices: int | None = None):
    """The spec's estimate under the recipe's trainer settings (precision as this machine runs
    it, devices, strategy and its layout, checkpointing), at ``seq_len`` tokens x ``batch``
    sequences per device.
    ``devices``: per node (default: the recipe's count, 1 for ``auto``; a run passes what the
    machine gives it)."""
    from builder.analysis.estimates import estimate
    from recipes.training.precision import resolve_precision

    settings = recipe.trainer
    precision, _ = resolve_precision(settings.precision, settings.accelerator)  # auto: what this machine runs
    dtype = "bf16" if precision.startswith("bf16") else "fp16" if precision == "16-mixed" else "fp32"
    if devices is None:
        devices = settings.devices if isinstance(settings.devices, int) and settings.devices > 0 else 1
    sharded = settings.strategy == "fsdp"
    return estimate(
        spec,
        seq_len=seq_len,
        batch=batch,
        dtype=dtype,
        devices=devices * settings.num_nodes,
        strategy="fsdp" if sharded else "ddp",
        activation_checkpointing=settings.activation_checkpointing,
        nodes=settings.num_nodes,
        tensor_parallel=settings.tensor_parallel if sharded else 1,
        data_parallel=settings.data_parallel,
    )


# -- the command -------------------------------------------------------------------------------------


def dry_run(recipe_path: str | Path, overrides: dict[str, Any] | None = None, out=None) -> dict:
    """Resolve and print everything ``builder train`` would use; returns it as plain data."""
    import sys

    import yaml
    from rich.console import Console

    from builder.analysis.report import human, print_describe
    from builder.zoo import shown
    from recipes.recipe.kind import recipe_path as locate_recipe
    from recipes.recipe.sections import load_recipe, model_spec, output_dir, spec_file

    out = out or sys.stdout
    recipe_file = locate_recipe(recipe_path)
    recipe = load_recipe(recipe_file, overrides)
    files = data_files(recipe, recipe_file)
    missing = missing_inputs(recipe, recipe_file, files)
    if missing:
        raise RecipeError("; ".join(missing))
    vocab = vocabulary(recipe, recipe_file)
    spec = model_spec(recipe, recipe_file, vocab.size)
    seq_len, batch, shape = batch_shape(recipe, spec)
    if recipe.task in ("lm", "mlm") and recipe.data.seq_len > spec.max_seq_len:
        raise RecipeError(
            f"data.seq_len {recipe.data.seq_len} is longer than the model's max_seq_len "
            f"{spec.max_seq_len}; lower data.seq_len or set model.overrides.max_seq_len"
        )
    est = recipe_estimate(spec, recipe, seq_len, batch)
    run_dir = output_dir(recipe, recipe_file)
    last = run_dir / "checkpoints" / "last.ckpt"

    resolved = recipe.model_dump(mode="json")
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
    if recipe.task == "lm":
        lines += [("mixture", line) for line in mixture_lines(recipe, recipe_file)]
    lines.append(("devices", devices_line(recipe)))
    from builder.hf import export_line

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


def mixture_lines(recipe: Recipe, recipe_file: Path) -> list[str]:
    """Per source that is already tokens (tokenized datasets, Megatron and raw files): its training
    tokens, its share of the windows and the passes the run makes over it, with a warning past
    its ``max_epochs``; text is tokenized at the first run, so its count is not known here."""
    from recipes.data.corpus import kind_of, source_tokens

    data = recipe.data
    entries = data.entries()
    kinds = [kind_of(e, data, recipe_file) for e in entries]
    if all(kind == "text" for kind, _ in kinds) and len(entries) == 1:
        return []
    tokens = [source_tokens(e, kind, path, data) if kind != "text" else None for e, (kind, path) in zip(entries, kinds)]
    weights = [e.weight for e in entries]
    known = all(w is not None for w in weights) or all(t is not None for t in tokens)
    raw = [w if w is not None else t for w, t in zip(weights, tokens)]
    settings = recipe.trainer
    total = settings.max_steps * data.batch_size * settings.accumulate_grad_batches * data_parallel_ranks(recipe)
    lines = []
    for entry, n, part in zip(entries, tokens, raw):
        if n is None:
            lines.append(
                f"{entry.path}: text, tokenized at the first run"
                + (f"; weight {entry.weight:g}" if entry.weight is not None else "")
            )
            continue
        line = f"{entry.path}: {n:,} training tokens"
        if known:
            share = part / sum(raw)
            epochs = total * share / max(1, n // data.seq_len)
            line += f", {share:.1%} of the windows, {epochs:.2f} epochs in {settings.max_steps:,} steps"
            if entry.max_epochs is not None and epochs > entry.max_epochs:
                line += f" -- WARNING: past its max_epochs {entry.max_epochs:g}; train refuses this"
        lines.append(line)
    return lines


def data_parallel_ranks(recipe: Recipe) -> int:
    """Ranks that read different data in the recipe's layout, as the dry run counts devices."""
    settings = recipe.trainer
    total = _accelerator(settings.accelerator, settings.devices)[1] * settings.num_nodes
    return max(1, total // (settings.tensor_parallel if settings.strategy == "fsdp" else 1))


def _data_line(f: DataFile) -> str:
    if f.path is None:
        return f"{f.what}: files of this machine, nothing downloaded"
    if f.present:
        return f"{f.what}: {f.path} (on disk)"
    if f.url:
        terms = f"; terms: {f.terms}" if f.terms else ""
        return f"{f.what}: would download {f.url} ({f.size / 1e6:.1f} MB) to {f.path}{terms}"
    return f"{f.what}: {f.path} (MISSING)"
