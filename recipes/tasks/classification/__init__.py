"""``task: classification``: an encoder-only model and a classification head on labelled text,
from scratch or from an MLM checkpoint. This module (torch-free) is its recipe schema and its
:class:`~yamlformer.recipes.tasks.task.Task`; ``training.py`` reads the examples, trains and scores."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.data.section import DatasetFields
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import RECIPE_PATH, WORK_PATH, _Section, default_cache_dir, resolve
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.mlm import TASK as MASKED_LM
from yamlformer.recipes.tasks.mlm import check_encoder
from yamlformer.recipes.tasks.task import TokenBudget, TokenBudgetTask, Vocabulary


class LabeledDataSection(DatasetFields):
    split: str | None = Field(
        None,
        description="With `dataset`: the split read, each of its files one label (for multi30k, the "
        "language); null: the training split.",
    )
    file: str | None = Field(
        None,
        description="A .csv (with a header) or .jsonl file of examples (relative to the recipe).",
        json_schema_extra=RECIPE_PATH,
    )
    by_label: dict[str, str] | None = Field(
        None,
        description="Instead of `file`: label -> a text file of that label's examples, one a line.",
        json_schema_extra=RECIPE_PATH,
    )
    validation: str | None = Field(
        None,
        description="A held-out file like `file` (null: the last val_fraction of the shuffled examples).",
        json_schema_extra=RECIPE_PATH,
    )
    text_field: str = Field("text", description="The column or key holding the text.")
    label_field: str = Field("label", description="The column or key holding the label.")
    labels: list[str] | None = Field(
        None, description="Label names in id order (null: the sorted distinct labels of the training data)."
    )
    val_fraction: float = Field(0.1, gt=0, lt=1, description="Held out when there is no validation file.")
    limit: int | None = Field(None, ge=1, description="Use only this many examples (after shuffling).")
    max_len: int = Field(128, ge=3, description="Tokens per example, [CLS] and [SEP] included (longer: cut).")
    max_tokens: int = Field(4096, ge=8, description="Token budget of a micro-batch, padding included.")
    bucket_size: int = Field(100, ge=1, description="Batches per length-sorted bucket.")
    cache_dir: str = Field(
        default_factory=default_cache_dir,
        description="Tokenizers, keyed by content hash (default: the user "
        "cache, ~/.cache/builder on Linux; ./.cache/builder where one is left from an earlier version).",
        json_schema_extra=WORK_PATH,
    )

    @model_validator(mode="after")
    def _one_source(self):
        if sum(x is not None for x in (self.file, self.by_label, self.dataset)) != 1:
            raise rule_error(
                (),
                "give data.file (csv or jsonl), data.by_label (label -> text file) or data.dataset "
                "(its split's files, one label each), one of them",
            )
        if self.dataset is not None and self.split is not None:
            # local: the dataset registry (urllib, http) loads only when a dataset is named
            from yamlformer.recipes.data.registry import get

            splits = list(get(self.dataset).splits)
            if self.split not in splits:
                raise rule_error(("split",), f"data.split {self.split!r}: {self.dataset} has {splits}")
        return self


class ClassificationSection(_Section):
    init_from: str | None = Field(
        None,
        description="An MLM checkpoint (relative to the recipe) whose encoder and tokenizer start the model.",
        json_schema_extra=RECIPE_PATH,
    )
    pooling: Literal["first", "mean"] = Field("first", description="first ([CLS]) | mean over real tokens.")
    pooler: bool = Field(False, description="BERT's tanh pooler before the classifier.")
    dropout: float = Field(0.1, ge=0, lt=1, description="Dropout before the classifier.")


class ClassificationRecipe(Recipe):
    """``task: classification``: an encoder-only model and a classification head, on labelled text."""

    splits_windows: ClassVar[bool] = False  # its batches are examples of their own lengths, not windows

    task: Literal["classification"] = Field("classification", description="classification.")
    data: LabeledDataSection = Field(..., description="The labelled examples.")
    classification: ClassificationSection = Field(
        default_factory=ClassificationSection, description="The head and an optional pretrained start."
    )

    @model_validator(mode="after")
    def _classification_rules(self):
        if self.tokenizer.type != "sentencepiece":
            raise rule_error(
                ("tokenizer", "type"),
                "tokenizer.type: classification needs a sentencepiece tokenizer ([PAD], [CLS], [SEP])",
            )
        return self


class ClassificationResolution(TokenBudget):
    @functools.cached_property
    def spec_overrides(self) -> dict:
        """The classification head, of as many classes as the training examples have labels."""
        settings = self.recipe.classification
        return {
            "head": {
                "type": "classification",
                "n_classes": len(labels_of(self.located, self.read_data)),
                "pooling": settings.pooling,
                "pooler": settings.pooler,
                "dropout": settings.dropout,
            }
        }

    def check_spec(self, spec) -> None:
        check_encoder(self.recipe, spec)

    @functools.cached_property
    def vocabulary(self) -> Vocabulary | None:
        """A pretrained encoder's tokenizer is the run's (``classification.init_from``)."""
        recipe, recipe_file = self.recipe, self.located.file
        init_from = recipe.classification.init_from
        if init_from is None:
            return None
        path = resolve(recipe_file, init_from)
        if self.read_data and path.is_file():
            return Vocabulary(_checkpoint_vocabulary(path), f"the tokenizer of classification.init_from {path}")
        size = recipe.tokenizer.vocab_size
        return Vocabulary(
            size,
            f"the tokenizer of classification.init_from {path} (not read here; estimated with "
            f"tokenizer.vocab_size {size:,})",
            True,
        )

    def add_files(self, files) -> None:
        data = self.recipe.data
        if data.dataset is not None:
            files.dataset(data.dataset, [data.split or files.registry(data.dataset).train])
        files.own("data.file", data.file)
        for label, path in (data.by_label or {}).items():
            files.own(f"data.by_label.{label}", path)
        files.own("data.validation", data.validation)


class Classification(TokenBudgetTask):
    name = "classification"
    recipe = ClassificationRecipe
    resolution = ClassificationResolution
    eval_options = ("data",)  # every example of the file or the validation split
    generate_options = ()

    def prepare(self, run, samples: bool):
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.classification.training import prepare_classification

        return prepare_classification(run)

    def check_eval_arguments(self, args) -> None:
        # local: builder validate loads this module; the CLI's argument types load for builder eval
        from yamlformer.builder.cli.arguments import ArgumentError

        data = getattr(args, "data", None)
        if data and len(data) > 1:
            raise ArgumentError(
                f"--data takes one file of labelled examples for a classification checkpoint, got {len(data)}"
            )

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.classification.training import evaluate

        self.check_meta(meta)
        return evaluate(model, tokenizer, self.recipe.model_validate(meta["recipe"]), meta, args)

    def generate(self, model, tokenizer, meta: dict, args) -> None:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.classification.training import generate

        self.check_meta(meta)
        print(generate(model, tokenizer, meta, args))


def labels_of(located, read_data: bool) -> list[str]:
    """The label names a run trains with: ``data.labels``, else those of its training examples,
    read when ``read_data`` and every file is on disk; else the names the data section gives
    (``by_label``'s keys, a dataset split's files) or, for a file not read, two stand-ins."""
    recipe, recipe_file = located.recipe, located.file
    data = recipe.data
    if data.labels:
        return list(data.labels)
    if read_data and _on_disk(located):
        # local: reading the examples is the training side's (it imports torch)
        from yamlformer.recipes.tasks.classification.training import class_labels, labelled_examples

        return class_labels(data, labelled_examples(data, recipe_file, recipe.trainer.seed)[0])
    if data.by_label is not None:
        return sorted(data.by_label)
    if data.dataset is not None:
        # local: the dataset registry (urllib, http) loads only when a dataset is named
        from yamlformer.recipes.data.registry import get

        return sorted(get(data.dataset).splits[data.split or get(data.dataset).train])
    return ["(a label)", "(another)"]  # a file not read: the head is estimated with two classes


def _on_disk(located) -> bool:
    recipe, recipe_file = located.recipe, located.file
    data = recipe.data
    if data.dataset is None:
        return True  # the recipe's own files (checked to be there before the spec is resolved)
    # local: the dataset registry (urllib, http) loads only when a dataset is named
    from yamlformer.recipes.data.registry import data_root, get

    dataset = get(data.dataset)
    root = data_root(data.dataset_root(recipe_file))
    files = dataset.splits[data.split or dataset.train].values()
    return all(root.joinpath(*dataset.file(path).path.split("/")).is_file() for path in files)


def _checkpoint_vocabulary(path: Path) -> int:
    """The vocabulary size of the tokenizer a ``builder train`` checkpoint carries, read and
    verified through ``yamlformer.builder.checkpoints`` (a run that reads it again for its weights reads it
    once)."""
    # local: a checkpoint's readers (torch) load when one is read; this module stays torch-free
    from yamlformer.builder.checkpoints import CheckpointError, read_meta
    from yamlformer.recipes.trained import checkpoint_tokenizer

    try:
        meta = read_meta(path)["builder"]
        MASKED_LM.check_meta(meta)
        return checkpoint_tokenizer(path, meta.get("tokenizer")).vocab_size
    except (CheckpointError, RecipeError) as exc:
        named = str(exc) if str(path) in str(exc) else f"{path}: {exc}"  # the line names the file it read
        raise RecipeError(f"classification.init_from: {named}") from None


TASK = Classification()
