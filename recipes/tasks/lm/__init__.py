"""``task: lm`` (the default): next-token prediction on windows of a corpus. This module
(torch-free) is its :class:`~yamlformer.recipes.tasks.task.Task` and its resolution, and
:class:`Corpus` and :class:`CorpusResolution`, what every task that reads a corpus of windows
shares (the masked LM too); its recipe schema is the base
:class:`~yamlformer.recipes.recipe.sections.Recipe`. ``training.py`` prepares the data, evaluates and samples;
``streaming.py`` decodes text as the tokens come."""

from __future__ import annotations

import functools
import importlib.util

from pydantic import Field

from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import _Section
from yamlformer.recipes.recipe.sections import Recipe, SourceEntry
from yamlformer.recipes.tasks.task import Resolution, Task, Vocabulary, scored


class HarnessSection(_Section):
    """lm-evaluation-harness tasks scored on the training model every ``every_n_steps`` steps
    (``recipes/tasks/lm/harness.py``), logged as ``harness/TASK/METRIC`` beside the losses."""

    tasks: list[str] = Field(..., min_length=1, description="lm-eval task names (or tasks in task_path).")
    every_n_steps: int = Field(..., ge=1, description="Score them every this many optimizer steps.")
    task_path: str | None = Field(
        None, description="A folder of lm-eval YAML task files, relative to the recipe (local data: no download)."
    )
    limit: int | None = Field(None, ge=1, description="At most this many examples per task (null: all).")
    num_fewshot: int | None = Field(None, ge=0, le=64, description="Few-shot examples (null: each task's own).")
    batch_size: int = Field(16, ge=1, le=4096, description="Requests scored per forward pass.")


class LMRecipe(Recipe):
    """The language-modelling recipe: the base recipe and an optional in-training harness."""

    harness: HarnessSection | None = Field(
        None, description="Downstream tasks (lm-eval) scored during training; needs the harness extra."
    )


class CorpusResolution(Resolution):
    """The resolution of a task that trains on windows of ``data.seq_len`` tokens of a corpus
    (``data.sources``, a dataset, tokenized datasets): its vocabulary, files and checks."""

    @functools.cached_property
    def vocabulary(self) -> Vocabulary | None:
        """A tokenized dataset's tokenizer is the run's (:mod:`yamlformer.recipes.data.corpus`)."""
        recipe, recipe_file = self.recipe, self.located.file
        # local: the data side (numpy, the corpus readers) loads when data is read
        from yamlformer.recipes.data.corpus import kind_of
        from yamlformer.recipes.data.tokenized import TokenizedDataset

        for entry in recipe.data.entries():
            kind, path = kind_of(entry, recipe.data, recipe_file)
            if kind == "tokenized":
                dataset = TokenizedDataset.open(path)
                kind = dataset.manifest["tokenizer"]["kind"]
                return Vocabulary(
                    dataset.vocab_size, f"{kind} from the tokenized dataset {path} (the one it was made with)"
                )
        return None

    def add_files(self, files) -> None:
        recipe, recipe_file = self.recipe, self.located.file
        # local: the data side (numpy, the corpus readers) loads when data is read
        from yamlformer.recipes.data.corpus import kind_of

        data = recipe.data
        for entry in data.entries():
            if files.is_dataset(entry.path):
                splits = files.registry(entry.path).splits
                files.dataset(entry.path, [files.registry(entry.path).train] if splits else [])
                continue
            kind, where = kind_of(entry, data, recipe_file)
            what = "data.sources" if kind == "text" else f"data.sources ({kind})"
            files.add(what, where, kind != "text" or where.exists())
            if entry.validation is not None:
                held = SourceEntry(path=entry.validation, dtype=entry.dtype)
                kind, where = kind_of(held, data, recipe_file)
                files.add("data.sources.validation", where, kind != "text" or where.exists())

    def check_spec(self, spec) -> None:
        recipe = self.recipe
        if recipe.data.seq_len > spec.max_seq_len:
            raise RecipeError(
                f"data.seq_len {recipe.data.seq_len} is longer than the model's max_seq_len {spec.max_seq_len}; "
                "lower data.seq_len or set model.overrides.max_seq_len"
            )

    def check_data(self, vocab_size: int, pretrained: dict | None) -> None:
        recipe, recipe_file, task = self.recipe, self.located.file, self.task
        # local: the corpus reads token files with numpy
        from yamlformer.recipes.data.corpus import check_sources

        tokenizer = None
        if pretrained is not None:
            # local: the tokenizer libraries load for a model.init_from checkpoint's tokenizer only
            from yamlformer.recipes.data.tokenizers import from_state

            tokenizer = from_state(pretrained)
        check_sources(
            task.corpus_section(recipe),
            recipe_file,
            vocab_size,
            task.total_windows(recipe),
            task.trains_tokenizer(recipe),
            tokenizer,
        )


class Corpus:
    """A :class:`Task` that trains on windows of ``data.seq_len`` tokens of a corpus: how it cuts
    them, which both halves ask (:class:`CorpusResolution`'s checks, the data stage)."""

    def corpus_section(self, recipe):
        """The data section as the corpus is opened with (its windows' length)."""
        return recipe.data

    def trains_tokenizer(self, recipe) -> bool:
        """Whether the recipe's tokenizer is made from its text (char, or sentencepiece without a file)."""
        settings = recipe.tokenizer
        return settings.type == "char" or (settings.type == "sentencepiece" and settings.model_file is None)

    def total_windows(self, recipe) -> int | None:
        """The training windows a run draws over every data-parallel rank (None: its sources'
        epoch limits are not checked)."""
        # local: the parallel package imports torch (this facade serves builder validate, torch-free)
        from yamlformer.recipes.parallel.mesh import data_parallel_ranks

        settings = recipe.trainer
        ranks = data_parallel_ranks(settings, check=False)
        return settings.max_steps * recipe.data.batch_size * settings.accumulate_grad_batches * ranks


class LMResolution(CorpusResolution):
    def check_data(self, vocab_size: int, pretrained: dict | None) -> None:
        super().check_data(vocab_size, pretrained)
        if self.recipe.harness is not None:
            harness_available()

    @functools.cached_property
    def dry_run_lines(self) -> tuple[tuple[str, str], ...]:
        return tuple(("mixture", line) for line in mixture_lines(self.located))


class LanguageModelling(Corpus, Task):
    name = "lm"
    recipe = LMRecipe
    resolution = LMResolution
    eval_options = ("data", "seq_len", "batch_size", "max_batches", "all", "tasks", "task_path", "limit", "num_fewshot")
    generate_options = ("max_new_tokens", "temperature", "top_k", "top_p", "num_beams", "seed", "compile")

    def prepare(self, run, samples: bool):
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.lm.training import prepare

        return prepare(run, samples)

    def check_eval_arguments(self, args) -> None:
        # local: builder validate loads this module; the CLI's argument types load for builder eval
        from yamlformer.builder.cli.arguments import ArgumentError

        given = [name for name in ("task_path", "limit", "num_fewshot") if getattr(args, name, None) is not None]
        if given and not getattr(args, "tasks", None):
            raise ArgumentError(f"--{given[0].replace('_', '-')} goes with --tasks")
        if getattr(args, "tasks", None) and (args.data or args.max_batches or args.all):
            raise ArgumentError("--tasks scores lm-eval tasks; --data, --max-batches and --all score the loss")

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        self.check_meta(meta)
        if getattr(args, "tasks", None):  # downstream tasks through lm-eval (recipes/tasks/lm/harness.py)
            try:
                # optional extra: lm-eval (pip install 'yamlformer[harness]')
                from yamlformer.recipes.tasks.lm.harness import BuilderLM, evaluate_tasks
            except ImportError as exc:
                raise RecipeError(f"--tasks needs lm-eval ({exc}): pip install 'yamlformer[harness]'") from None
            lm = BuilderLM(model, tokenizer, batch_size=args.batch_size or 16, max_length=args.seq_len)
            return {"harness": evaluate_tasks(lm, args.tasks, args.task_path, args.limit, args.num_fewshot)}
        # optional extra: lm-eval (pip install 'yamlformer[harness]')
        from yamlformer.recipes.tasks.lm.training import evaluate_checkpoint

        return evaluate_checkpoint(model, tokenizer, meta, args)

    def print_evaluation(self, result: dict, args) -> None:

        if "harness" in result:
            print(f"{result['checkpoint']} (step {result['step']}), lm-eval:")
            for name, value in result["harness"].items():
                print(f"  {name}: {value:.4f}")
            return
        print(
            f"{result['checkpoint']} (step {result['step']}) on {result['data']}: {result['tokens']:,} tokens, "
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
        )
        print(scored(result["batches"], result["batches_available"], args))

    def generate(self, model, tokenizer, meta: dict, args) -> None:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.lm.training import generate

        self.check_meta(meta)
        generate(model, tokenizer, args)


def harness_available() -> None:
    """Refuse a ``harness:`` section without lm-evaluation-harness installed (one line naming the extra)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise RecipeError("harness: needs lm-eval (no module named 'lm_eval'): pip install 'yamlformer[harness]'")


def mixture_lines(located) -> list[str]:
    """Per source that is already tokens (tokenized datasets, Megatron and raw files): its training
    tokens, its share of the windows and the passes the run makes over it, with a warning past
    its ``max_epochs``; text is tokenized at the first run, so its count is not known here."""
    recipe, recipe_file = located.recipe, located.file
    # local: the data side (numpy, the corpus readers) loads when data is read
    from yamlformer.recipes.data.corpus import kind_of, source_tokens

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
    total = TASK.total_windows(recipe)
    lines = []
    for entry, n, part in zip(entries, tokens, raw):
        if n is None:
            lines.append(
                f"{entry.path}: text, tokenized at the first run"
                + (f"; weight {entry.weight:g}" if entry.weight is not None else "")
            )
            continue
        line = f"{entry.path}: {n:,} training tokens"
        if known:  # a source past its max_epochs was refused with the run's line (CorpusResolution.check_data)
            share = part / sum(raw)
            epochs = total * share / max(1, n // data.seq_len)
            line += f", {share:.1%} of the windows, {epochs:.2f} epochs in {settings.max_steps:,} steps"
        lines.append(line)
    return lines


TASK = LanguageModelling()
