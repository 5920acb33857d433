"""What a task is to the rest of the project: the :class:`Task` contract, and the values it hands
back (:class:`Resolution` to the resolution, which the dry run, ``builder validate`` and ``builder
list`` share, with its :class:`Vocabulary` and its files,
:class:`~yamlformer.recipes.tasks.files.DataFile`; :class:`Prepared` to the run loop).
Torch-free: a task's facade answers the questions that need no torch here and imports its
training code when asked to train, evaluate or generate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from yamlformer.recipes.errors import RecipeError

if TYPE_CHECKING:
    from yamlformer.builder.spec.schema import ModelSpec
    from yamlformer.recipes.recipe.located import LocatedRecipe
    from yamlformer.recipes.recipe.sections import Recipe
    from yamlformer.recipes.tasks.files import DataFile

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
    """What a task's data stage hands the rest of the run (:func:`yamlformer.recipes.training.run.train`);
    the spec is the run's (:class:`yamlformer.recipes.training.resolved.Run`), resolved before."""

    tokenizer: Any  # its vocabulary is the run's spec's (the run checks it)
    data: Any  # a LightningDataModule
    module_class: Callable  # (model, recipe, meta) -> the LightningModule (its class, or a function making one)
    seq_len: int  # the micro-batch shape for the start-of-run estimate
    batch: int
    #: a micro-batch -> the real (non-pad) tokens it trains on (an int or a device tensor); ``None``:
    #: every micro-batch is ``batch x seq_len`` tokens
    tokens_of: Callable | None = None
    meta: dict = dataclasses.field(default_factory=dict)  # task facts kept in checkpoints (labels...)
    init: Callable | None = None  # model -> None: weights from elsewhere (a pretrained encoder)
    callbacks: Callable | None = None  # checkpoint dir -> extra callbacks
    #: (module, whole model, checkpoint dir) -> final metrics, printed and returned (rank 0 only)
    finish: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The vocabulary a run's tokenizer will have: ``size`` and how it is known."""

    size: int
    how: str
    stand_in: bool = False  # the size is a stand-in until the data is read


@dataclasses.dataclass(frozen=True, eq=False)
class Resolution:
    """What a task makes of one recipe as loaded, before anything runs (:meth:`Task.resolve`): the
    files its data section reads, the vocabulary when the task knows it better than the tokenizer
    settings, the spec fields it sets, its checks of the spec and of the data, the micro-batch its
    estimate is made at, and the dry run's lines about it. Each task's is its own subclass.

    Made once per resolution (:func:`yamlformer.recipes.training.resolved.resolve_run`, which a
    run and its dry run share; ``resolve_model``, which ``builder validate``, ``builder list`` and
    a study's variants share) and kept in the ``Run``; never changed. An answer that reads data
    is made the first time it is asked, then kept: the resolution asks it only once every file is
    checked to be there and of a kind the run reads (a FIFO is refused, never read), so the
    order of the checks stays the run's."""

    task: Task
    located: LocatedRecipe
    read_data: bool = True  # the data may be read (a run, its dry run); validate and list read none

    @property
    def recipe(self) -> Recipe:
        return self.located.recipe

    @functools.cached_property
    def files(self) -> tuple[DataFile, ...]:
        """Every file the data section reads, in order, as it is on disk now; nothing fetched or read."""
        # local: the dataset registry (urllib, http) loads when a recipe is resolved; the tasks'
        # facades also serve every YAML command's keys (builder describe)
        from yamlformer.recipes.tasks.files import DataFiles

        files = DataFiles(self.located)
        self.add_files(files)
        return tuple(files.found)

    def add_files(self, files) -> None:
        """Add every file the data section reads to ``files``
        (:class:`yamlformer.recipes.tasks.files.DataFiles`), in order."""
        raise NotImplementedError

    @functools.cached_property
    def vocabulary(self) -> Vocabulary | None:
        """The vocabulary when the task knows it better than the tokenizer settings (a tokenized
        dataset's, a pretrained checkpoint's); ``None``: from ``tokenizer``."""
        return None

    @functools.cached_property
    def spec_overrides(self) -> dict:
        """Spec fields the task sets over the recipe's (a classification head of as many classes
        as the data has labels)."""
        return {}

    @functools.cached_property
    def dry_run_lines(self) -> tuple[tuple[str, str], ...]:
        """More ``(key, text)`` lines for the dry run's summary (an LM's mixture)."""
        return ()

    def check_spec(self, spec: ModelSpec) -> None:
        """Refuse (:class:`RecipeError`, one line) a spec this task cannot train or its data cannot run on."""

    def check_data(self, vocab_size: int, pretrained: dict | None) -> None:
        """Refuse (:class:`RecipeError`, one line) data the run would refuse, read as far as it can be
        without the run's work (no text tokenized); ``pretrained``: the tokenizer state of a
        ``model.init_from`` checkpoint. Every file is known to be there and of the right kind."""

    def batch_shape(self, spec: ModelSpec) -> tuple[int, int, str]:
        """``(seq_len, batch, how)``: the micro-batch shape estimates are made at."""
        data = self.recipe.data
        return data.seq_len, data.batch_size, f"{data.batch_size} windows x {data.seq_len} tokens"

    def reference_copy(self, spec: ModelSpec) -> bool:
        """Whether the run keeps a frozen copy of the model beside it (a reference model), which
        the estimates count (``yamlformer.builder.analysis.estimates.Step.reference``)."""
        return False


class Task:
    """One kind of training run (``task:`` in a recipe). A task is a folder of ``recipes/tasks/``:
    its ``__init__`` (torch-free) defines the recipe schema, its :class:`Resolution` and a
    :class:`Task` named ``TASK``; its training code (torch, Lightning) is imported by the methods
    that need it.

    Generic code (the run loop, the dry run, ``builder eval``/``generate``/``plan``/``list``) asks
    these methods and attributes and never a task's name.

    A run comes in two halves: :meth:`resolve`, handed the recipe as loaded (a
    :class:`~yamlformer.recipes.recipe.located.LocatedRecipe`), answers what the ``Run`` is made
    of in one value (:func:`yamlformer.recipes.training.resolved.resolve_run` asks it once, and
    the ``Run`` keeps it); :meth:`prepare` is handed the resolved ``Run`` and reads only it."""

    #: the ``task:`` value
    name: ClassVar[str]
    #: the recipe schema (a :class:`yamlformer.recipes.recipe.sections.Recipe`)
    recipe: ClassVar[type]
    #: what :meth:`resolve` makes: the task's :class:`Resolution`
    resolution: ClassVar[type[Resolution]]
    #: the ``builder eval`` / ``builder generate`` options this task reads (others are refused)
    eval_options: ClassVar[tuple[str, ...]] = ()
    generate_options: ClassVar[tuple[str, ...]] = ()

    def resolve(self, located: LocatedRecipe, read_data: bool = True) -> Resolution:
        """What this task makes of ``located`` before a run (``read_data``: the data may be read;
        ``builder validate`` and ``builder list`` read none)."""
        return self.resolution(self, located, read_data)

    def prepare(self, run, samples: bool) -> Prepared:
        """The data stage of ``run`` (a :class:`yamlformer.recipes.training.resolved.Run`): the
        tokenizer and the batches (``samples``: decode the recipe's prompts at the end)."""
        raise NotImplementedError

    def batch_settings(self, seq_len: int, micro_batch: int) -> list[str]:
        """The ``--set`` values of micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens
        (``builder plan --recipe``'s launch lines: a plan, not a recipe resolved)."""
        return [f"data.seq_len={seq_len}", f"data.batch_size={micro_batch}"]

    # -- a trained checkpoint: builder eval and builder generate ---------------------------------

    def check_eval_arguments(self, args) -> None:
        """Refuse (``ArgumentError``) a combination of ``builder eval`` options this task cannot take."""

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        """``builder eval``: the task's metrics on a checkpoint."""
        raise NotImplementedError

    def print_evaluation(self, result: dict, args) -> None:
        """``builder eval`` without ``--json``: the result, one ``key: value`` line each."""
        available = result.pop("batches_available", None)
        for key, value in result.items():
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
        if "batches" in result:
            print(scored(result["batches"], available, args))

    def generate(self, model, tokenizer, meta: dict, args) -> None:
        """``builder generate``: decode ``args.prompt`` and print it."""
        raise RecipeError(f"a checkpoint of task {self.name} does not generate; `builder eval` scores it")

    def check_meta(self, meta: dict) -> None:
        """Refuse a checkpoint of another task."""
        trained = meta.get("task", "lm")
        if trained != self.name:
            raise RecipeError(f"this checkpoint was trained for task {trained!r}, not {self.name}")


class TokenBudget(Resolution):
    """The :class:`Resolution` of a task whose micro-batches are examples of like lengths under
    ``data.max_tokens`` (``yamlformer.recipes.data.batching``): estimated at the longest batch it can make."""

    def batch_shape(self, spec: ModelSpec) -> tuple[int, int, str]:
        data = self.recipe.data
        longest = min(data.max_len, spec.max_seq_len)
        batch = max(1, data.max_tokens // longest)
        how = (
            f"the longest batch of data.max_tokens {data.max_tokens:,}: {batch} examples x {longest} tokens "
            "(data.max_len)"
        )
        return longest, batch, how


class TokenBudgetTask(Task):
    """A :class:`Task` whose micro-batches are cut by a token budget (:class:`TokenBudget`)."""

    def batch_settings(self, seq_len: int, micro_batch: int) -> list[str]:
        """Examples no longer than ``seq_len`` in ``micro_batch x seq_len`` tokens: at most what a
        plan sized."""
        return [f"data.max_len={seq_len}", f"data.max_tokens={micro_batch * seq_len}"]


def scored(batches: int, available: int | None, args) -> str:
    """``builder eval``'s line that says how much was scored, and how to score all of it."""
    if args.all:
        return f"scored all {batches:,} batches (--all)"
    how = f"--max-batches {args.max_batches}" if args.max_batches else "the recipe's trainer.limit_val_batches"
    drawn = "consecutive windows" if getattr(args, "data", None) else "the windows the run's validations drew"
    more = ""
    if available is not None and available != batches:  # --all: every consecutive window once
        more = f"; --all scores the whole data once instead ({available:,} consecutive batches)"
    return f"scored {batches:,} batches ({how}: {drawn}){more}"
