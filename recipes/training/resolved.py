"""A recipe resolved once. ``builder train`` and ``builder train --dry-run`` resolve a loaded recipe
(a :class:`~yamlformer.recipes.recipe.located.LocatedRecipe`) with :func:`resolve_run`; ``builder
validate``, ``builder list`` and a study's variants resolve its model with :func:`resolve_model`
(the same steps, no data read). Torch-free at import.

:class:`Run` is what the resolution makes, immutable and typed: the recipe as loaded
(``trainer.precision`` as this machine runs it, and that precision), its task, the tokenizer's
vocabulary, the model spec (validated, with ``model.overrides``, the task's own overrides and that
vocabulary: resolved here and nowhere else), the files it reads, its output folder, the
micro-batch shape its estimate is made at, the ``model.init_from`` source (read here, once) and
the tokenizer that source was trained with, where each ``model.freeze`` entry was written, and
what the task made of the recipe. Each stage of a run (data, model, trainer, wrap-up:
:mod:`yamlformer.recipes.training.run`) is handed the ``Run`` and reads it, never the recipe's
files again; the dry run prints it (:mod:`yamlformer.recipes.training.dry_run`). The task is
asked once per resolution, :meth:`Task.resolve
<yamlformer.recipes.tasks.task.Task.resolve>`, for one value (its files, vocabulary, spec
overrides, checks, micro-batch and dry-run lines: a
:class:`~yamlformer.recipes.tasks.task.Resolution`), which the ``Run`` keeps; the run's data
stage, :meth:`Task.prepare`, is handed the ``Run``.

The checks are the run's own, made before any work, so what the dry run accepts the run
accepts: every file there (or a dataset's, to download) and of a kind the run reads (no device,
pipe, socket or folder of no files), ``model.init_from`` a model that loads (its spec and
tokenizer read, a checkpoint verified), the spec against its task and the layout (tensor- and
expert-parallel splits, pipeline stages), and the data's windows wherever its tokens are known
without tokenizing text (tokenized datasets and token files: their ids, a training and a
validation window each, their epochs). What only the work can tell (a sentencepiece tokenizer
that cannot be trained on the text, pairs longer than the model) is found by the run. The one
difference is the machine: the dry run shows a layout this machine lacks with a warning (a
launch line meant for another machine), where the run refuses it.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from yamlformer.builder import paths
from yamlformer.builder.init_from import Source
from yamlformer.builder.outputs import shown
from yamlformer.builder.spec.schema import ModelSpec
from yamlformer.builder.spec.source import Mark, Problem, SpecError
from yamlformer.recipes.data import registry as datasets
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.init_from import init_from_errors, init_from_source, recipe_run, spec_base
from yamlformer.recipes.recipe.located import LocatedRecipe
from yamlformer.recipes.recipe.sections import Recipe, init_from_spec, model_spec
from yamlformer.recipes.tasks import load_recipe, task_named
from yamlformer.recipes.tasks.files import DataFile
from yamlformer.recipes.tasks.task import Resolution, Task, Vocabulary

#: the vocabulary a char tokenizer is estimated with before its corpus is read (bytes)
CHAR_STAND_IN = 256


@dataclasses.dataclass(frozen=True)
class Run:
    """A recipe resolved for a run: what every stage reads, made once (:func:`resolve_run`); no
    stage asks the recipe's files again."""

    located: LocatedRecipe  # loaded, --set applied, trainer.precision concrete for this machine
    resolution: Resolution  # what the task made of it (its files, checks, dry-run lines), asked once
    vocab: Vocabulary  # the tokenizer's size, and how it is known
    spec: ModelSpec  # validated, vocab_size the tokenizer's
    out: Path  # trainer.output_dir
    seq_len: int  # the micro-batch the estimate is made at, as the task cuts it
    batch: int
    shape: str  # that micro-batch, in words
    precision: str  # trainer.precision as this machine runs it (auto resolved)
    precision_note: str | None = None  # why trainer.precision: auto chose what it did (when that needs saying)
    source: Source | None = None  # model.init_from, read once: its spec, tokenizer and weights
    pretrained: dict | None = None  # the tokenizer that checkpoint was trained with (None: the recipe's)
    freeze_marks: tuple[Mark | None, ...] = ()  # where each model.freeze entry was written (None: --set)
    reference: bool = False  # a frozen copy of the model trains beside it (the estimate counts it)

    @property
    def recipe(self) -> Recipe:
        return self.located.recipe

    @property
    def task(self) -> Task:
        return self.resolution.task

    @property
    def files(self) -> tuple[DataFile, ...]:
        """Every file the data section reads, in order."""
        return self.resolution.files

    @property
    def file(self) -> Path:
        """The recipe file: its relative paths start in its folder."""
        return self.located.file

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def title(self) -> str:
        """``recipe name: model name``, for plots and reports."""
        return f"{self.located.name}: {self.spec.name}"


def resolve_run(located: LocatedRecipe, fetch: bool = False) -> Run:
    """``located`` resolved and checked for a run, nothing trained or written. ``fetch``: download
    what a named dataset lacks first (``builder train``: its vocabulary is then the real one);
    without it (``--dry-run``) a char tokenizer's corpus that is not downloaded yet is estimated
    with a stand-in vocabulary. ``model.init_from`` is read here, once, into the ``Run``, and the
    task is asked once (:meth:`Task.resolve`; again after a download: its files are there then)."""
    precision, note = _machine_precision(located.recipe)
    trainer = located.recipe.trainer.model_copy(update={"precision": precision})
    located = located.with_recipe(located.recipe.model_copy(update={"trainer": trainer}))
    recipe = located.recipe
    resolution = task_named(recipe.task).resolve(located)
    if fetch:
        resolution = fetch_missing(resolution)
    source = check_inputs(resolution)
    pretrained = tokenizer_state(source)
    vocab, spec = _resolved_model(resolution, source, pretrained)
    seq_len, batch, shape = resolution.batch_shape(spec)
    resolution.check_data(vocab.size, pretrained)
    check_stages(recipe, spec)
    marks = tuple(located.mark("model", "freeze", i) for i in range(len(recipe.model.freeze)))
    return Run(
        located, resolution, vocab, spec, located.out, seq_len, batch, shape, precision, note, source, pretrained,
        marks, resolution.reference_copy(spec),
    )  # fmt: skip


def resolve_model(located: LocatedRecipe, read_data: bool = False) -> tuple[Resolution, Vocabulary, ModelSpec]:
    """``(what the task made of it, vocabulary, spec)`` of a recipe as :func:`resolve_run` resolves
    them, checked against its task and layout, its files checked to be there; data is read only
    with ``read_data`` (``builder validate``, ``builder list`` and a study's variants read none)."""
    resolution = task_named(located.recipe.task).resolve(located, read_data)
    run = recipe_run(located.recipe.model.init_from, located.file)
    if run is None or run[1].exists():
        source = check_inputs(resolution)
        return resolution, *_resolved_model(resolution, source, tokenizer_state(source))
    # model.init_from names a recipe not trained yet: this recipe is checked with that recipe's
    # vocabulary and spec (validate, list); a run, and its dry run, refuse it until it is trained
    check_inputs(resolution, init_from=False)
    _, vocab, spec = resolve_model(load_recipe(run[0]), read_data)
    how = f"{vocab.how} (model.init_from {located.recipe.model.init_from}, not trained yet)"
    base = spec_base(spec.model_dump(mode="json"), f"<{run[0]}>")
    return resolution, *_resolved_model(resolution, None, None, dataclasses.replace(vocab, how=how), base)


def _resolved_model(
    resolution: Resolution,
    source: Source | None,
    pretrained: dict | None,
    vocab: Vocabulary | None = None,
    base: tuple[dict, str] | None = None,
) -> tuple[Vocabulary, ModelSpec]:
    located = resolution.located
    vocab = vocabulary(resolution, pretrained) if vocab is None else vocab
    if base is None and source is not None and located.recipe.model.spec is None:
        base = init_from_spec(source)
    spec = model_spec(located, vocab.size, resolution.spec_overrides, base)
    resolution.check_spec(spec)
    return vocab, spec


def _machine_precision(recipe: Recipe) -> tuple[str, str | None]:
    # local: the precision module imports torch to ask for the devices (this module is torch-free)
    from yamlformer.recipes.training.precision import resolve_precision

    return resolve_precision(recipe.trainer.precision, recipe.trainer.accelerator)


def check_stages(recipe: Recipe, spec: ModelSpec) -> None:
    """A pipeline the model's layers can be cut into (``trainer.pipeline_parallel``), checked on
    the model built on the meta device; tensor and expert splits are checked with the spec."""
    if recipe.trainer.strategy != "fsdp" or recipe.trainer.pipeline_parallel == 1:
        return
    # local: building even a meta model imports torch and the blocks (validate and list never get here)
    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.parallel.pipeline import check_pipeline

    check_pipeline(build_model(spec, device="meta"), recipe.trainer)


# -- the vocabulary ----------------------------------------------------------------------------------


def tokenizer_state(source: Source | None) -> dict | None:
    """The tokenizer a ``model.init_from`` checkpoint was trained with, as it recorded it (None:
    no such checkpoint, and the recipe's tokenizer is used)."""
    if source is None:
        return None
    with init_from_errors():
        return source.tokenizer_state()


def vocabulary(resolution: Resolution, pretrained: dict | None = None) -> Vocabulary:
    """The tokenizer's vocabulary size without training one, in the order a run picks its
    tokenizer: the task's when it knows it (a tokenized dataset's, a pretrained encoder's), the
    one a ``model.init_from`` checkpoint was trained with (``pretrained``, its recorded state),
    else from the tokenizer settings. With the data to be read (``resolution.read_data``), a char
    tokenizer counts the characters of its corpus when every file is on disk (else a stand-in)."""
    located, read_data = resolution.located, resolution.read_data
    recipe = located.recipe
    known = resolution.vocabulary
    if known is not None:
        return known
    settings = recipe.tokenizer
    if pretrained is not None or settings.type == "hf" or (settings.type == "sentencepiece" and settings.model_file):
        # local: the tokenizers import sentencepiece and Hugging Face's tokenizers
        from yamlformer.recipes.data.tokenizers import build_tokenizer, from_state

        if pretrained is not None:
            how = f"the tokenizer model.init_from {recipe.model.init_from} was trained with"
            return Vocabulary(_tokenizer_size(from_state, pretrained), how)
        tokenizer = build_tokenizer(settings, "", "", Path(recipe.data.cache_dir), located.file)
        return Vocabulary(tokenizer.vocab_size, f"{settings.type} tokenizer from {settings.model_file}")
    if settings.type == "char":
        missing = [f for f in resolution.files if not f.present]
        if read_data and not missing:
            # local: reading the corpus is the data side (validate and list never read it)
            from yamlformer.recipes.data.corpus import read_corpus
            from yamlformer.recipes.data.tokenizers import CharTokenizer

            size = CharTokenizer.fit(read_corpus(recipe.data, located.file).text, eos=True).vocab_size
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


def _tokenizer_size(from_state, state: dict) -> int:
    try:
        return from_state(state).vocab_size
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise RecipeError(f"model.init_from: its tokenizer cannot be read ({type(exc).__name__})") from None


# -- the files --------------------------------------------------------------------------------------


def fetch_missing(resolution: Resolution) -> Resolution:
    """Download the dataset files ``resolution`` lacks (each verified, as a run's first read
    would); the recipe resolved again when any was (its files are on disk now), else ``resolution``."""
    located, files = resolution.located, resolution.files
    if not any(f.url and not f.present for f in files):
        return resolution
    for name in dict.fromkeys(f.what.split(" ")[0] for f in files if f.url and not f.present):
        dataset = datasets.get(name)
        root = located.recipe.data.dataset_root(located.file)
        for split in dataset.splits:
            if any(f.what == f"{name} {split}" for f in files):
                datasets.split_files(name, split, root)
    return resolution.task.resolve(located, resolution.read_data)


def _close_names(path: Path) -> str:
    """``; did you mean 'x'?`` for entries of ``path``'s folder whose names are close to its own."""
    try:
        names = [entry.name for entry in path.parent.iterdir()] if path.parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.6)
    return "; did you mean " + " or ".join(repr(str(path.parent / c)) for c in close) + "?" if close else ""


def _missing(resolution: Resolution) -> list[tuple[str, Path, str]]:
    """``(field, path, message)`` of each file the recipe names that is not there and will not be
    downloaded: the path it was looked for at (relative paths: from the recipe's folder) and close
    names beside it; a link to nothing or a loop of links is said as what it is
    (:func:`yamlformer.builder.paths.path_problem`). Data files a dataset downloads on the first
    run are not missing. (A missing ``tokenizer.model_file`` is refused when the recipe loads.)"""
    located = resolution.located
    absent = [f for f in resolution.files if f.path is not None and not f.present and not f.url]
    found = [(f.what, f.path, _absent(f.path)) for f in absent]
    for field, value in _named(located):
        path = located.path(value)
        if not path.exists():
            found.append((field, path, _absent(path)))
    return found


def _absent(path: Path) -> str:
    if paths.exists(path):  # something is there: a link to nothing, a loop of links
        return f"{shown(path)}: {paths.path_problem(path, folder=True)}"
    return f"no such file or folder {shown(path)}{_close_names(path)}"


def _named(located: LocatedRecipe) -> list[tuple[str, str]]:
    """``(field, value)`` of the paths a recipe names outside its data section that a run reads
    (a file or a folder): ``model.init_from`` when it is no recipe, a classifier's encoder."""
    recipe = located.recipe
    named = [("classification.init_from", getattr(getattr(recipe, "classification", None), "init_from", None))]
    if recipe_run(recipe.model.init_from, located.file) is None:  # a recipe's run's checkpoint: check_inputs
        named.insert(0, ("model.init_from", recipe.model.init_from))
    return [(field, value) for field, value in named if value is not None]


def input_problems(resolution: Resolution) -> list[tuple[str, Path, str]]:
    """``(field, path, message)`` of each file the run would refuse before reading it: missing
    (:func:`_missing`), or there but not what the run reads, as
    :func:`yamlformer.builder.paths.path_problem` says (a device such as ``/dev/zero``, a FIFO or
    a socket, which would never end or never answer; a file that cannot be read; a folder where a
    file is read whole). The one verdict the run's readers give."""
    located = resolution.located
    recipe = located.recipe
    problems = _missing(resolution)
    there = [(f.what, f.path, not f.file) for f in resolution.files if f.path is not None and f.present]
    there += [(field, located.path(value), True) for field, value in _named(located)]
    model_file = getattr(getattr(recipe, "tokenizer", None), "model_file", None)
    if model_file is not None:
        there.append(("tokenizer.model_file", located.path(model_file), recipe.tokenizer.type == "hf"))
    for field, path, folder in there:
        why = paths.path_problem(path, folder=folder) if paths.exists(path) else None
        if why is not None:
            problems.append((field, path, f"{shown(path)}: {why}"))
    return problems


def check_inputs(resolution: Resolution, init_from: bool = True) -> Source | None:
    """Refuse, as the run would, a recipe whose files are missing or are not what the run reads
    (:func:`input_problems`), each problem located at the line of the recipe that names the file
    (a :class:`SpecError`, as ``builder validate``, ``builder train`` and its dry run print it),
    or whose ``model.init_from`` is no model that loads (its spec, and a checkpoint's tokenizer,
    read; a recipe, its run's last checkpoint: one not trained yet is refused).
    Returns that model's source, read (None: none, or ``init_from=False``: that model is not asked
    for, a recipe not trained yet as validate and list see it)."""
    located = resolution.located
    problems = input_problems(resolution)
    if problems:
        raise SpecError([_located(located, field, path, message) for field, path, message in problems])
    source = init_from_source(located) if init_from else None
    if source is not None:
        with init_from_errors():
            source.spec_dict()
            source.tokenizer_state()
    return source


def _located(located: LocatedRecipe, what: str, path: Path, message: str) -> Problem:
    """A problem with the file at ``path`` that field ``what`` names (``data.sources``,
    ``data.sources (tokenized)``, ``data.train.source``), at the line of the recipe where that
    path is written (an item of a list, a weighted entry's ``path``); a path given with ``--set``,
    or a dataset's file, is named by the field alone."""
    field, doc = what.split(" ")[0], located.written
    top = tuple(field.split("."))[:2]
    for where, value in _strings(doc.data, ()):
        if where[:2] == top and located.path(value) == path:
            mark = doc.value_mark(where)
            if mark is not None:
                return Problem.at(mark, where, message)
    return Problem(str(located.file), None, None, field, message)


def _strings(data, where: tuple) -> list[tuple[tuple, str]]:
    """``(field path, value)`` of every string in a document's data."""
    if isinstance(data, str):
        return [(where, data)]
    if isinstance(data, dict):
        return [found for key, value in data.items() for found in _strings(value, (*where, key))]
    if isinstance(data, list):
        return [found for i, value in enumerate(data) for found in _strings(value, (*where, i))]
    return []
