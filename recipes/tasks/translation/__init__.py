"""``task: translation``: an encoder-decoder trained on sentence pairs and scored with sacreBLEU,
the original Transformer's task. This module (torch-free) is its recipe schema and its
:class:`~yamlformer.recipes.tasks.task.Task`; ``training.py`` trains, evaluates and decodes."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.data.section import DatasetFields
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import RECIPE_PATH, WORK_PATH, _Section, default_cache_dir
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.task import TokenBudget, TokenBudgetTask


class ParallelFiles(_Section):
    source: str = Field(
        ...,
        description="Source sentences, one a line (path relative to the recipe).",
        json_schema_extra=RECIPE_PATH,
    )
    target: str = Field(
        ...,
        description="Their translations, line for line (path relative to the recipe).",
        json_schema_extra=RECIPE_PATH,
    )


class ParallelDataSection(DatasetFields):
    source_lang: str | None = Field(None, description="With `dataset`: the language translated from (de).")
    target_lang: str | None = Field(None, description="With `dataset`: the language translated into (en).")
    train: ParallelFiles | None = Field(None, description="The training pairs (null: the dataset's training split).")
    validation: ParallelFiles | None = Field(
        None, description="The held-out pairs: validation loss, BLEU and chrF (null: the dataset's validation split)."
    )
    max_tokens: int = Field(
        2000, ge=8, description="Token budget of a micro-batch: pairs x the longest side, padding included."
    )
    max_len: int = Field(128, ge=2, description="Training pairs with a side longer than this many tokens are left out.")
    bucket_size: int = Field(
        100,
        ge=1,
        description="Batches per bucket: pairs are sorted by length within buckets of "
        "this many batches' worth, so a batch holds like lengths yet the order stays random.",
    )
    limit_pairs: int | None = Field(None, ge=1, description="Use only the first this many training pairs (null: all).")
    cache_dir: str = Field(
        default_factory=default_cache_dir,
        description="Tokenizers, keyed by content hash (default: the user "
        "cache, ~/.cache/builder on Linux; ./.cache/builder where one is left from an earlier version).",
        json_schema_extra=WORK_PATH,
    )

    @model_validator(mode="after")
    def _pairs(self):
        if self.dataset is None:
            missing = [role for role in ("train", "validation") if getattr(self, role) is None]
            if missing:
                raise rule_error(
                    ("dataset",),
                    f"give data.dataset (e.g. multi30k) or data.{' and data.'.join(missing)} (source and target files)",
                )
            return self
        # local: the dataset registry (urllib, http) loads only when a dataset is named
        from yamlformer.recipes.data.registry import get

        dataset = get(self.dataset)
        langs = dataset.keys
        if self.source_lang not in langs or self.target_lang not in langs or self.source_lang == self.target_lang:
            raise rule_error(
                ("source_lang",),
                f"data.source_lang and data.target_lang: two of {dataset.name}'s languages "
                f"{langs} (got {self.source_lang!r} and {self.target_lang!r})",
            )
        if self.validation is None:
            dataset.split_of("validation")
        return self


class TranslationEval(_Section):
    num_beams: int = Field(4, ge=1, description="Beam size of the final evaluation (1: greedy).")
    length_penalty: float = Field(
        1.0,
        description="Beam score = sum log p / length ** length_penalty. (The paper's 0.6 is for "
        "GNMT's ((5 + length) / 6) ** alpha; with this plain form 1.0 scored higher on Multi30k.)",
    )
    max_len_a: float = Field(1.5, ge=0, description="At most a * source_length + b new tokens.")
    max_len_b: int = Field(10, ge=1, description="See max_len_a.")
    bleu_at_validation: bool = Field(
        True, description="Decode the validation set greedily at each validation and log val_bleu."
    )
    max_sentences: int | None = Field(
        None, ge=1, description="Score only the first this many validation pairs (null: all)."
    )
    average_last: int = Field(
        5,
        ge=1,
        description="Keep the last N checkpoints (one every average_every_n_steps) and "
        "average their weights into averaged.ckpt at the end, as the paper does.",
    )
    average_every_n_steps: int = Field(200, ge=1, description="Steps between the averaged checkpoints.")


class TranslationRecipe(Recipe):
    """``task: translation``: an encoder-decoder trained on sentence pairs, scored with sacreBLEU."""

    splits_windows: ClassVar[bool] = False  # its batches are examples of their own lengths, not windows

    task: Literal["translation"] = Field("translation", description="translation.")
    data: ParallelDataSection = Field(..., description="The parallel text and its batches.")
    eval: TranslationEval = Field(default_factory=TranslationEval, description="Decoding and scoring.")

    @model_validator(mode="after")
    def _translation_rules(self):
        if self.tokenizer.type != "sentencepiece":
            raise rule_error(
                ("tokenizer", "type"),
                "tokenizer.type: translation needs a sentencepiece tokenizer (pad, bos and eos ids)",
            )
        return self


class TranslationResolution(TokenBudget):
    def check_spec(self, spec) -> None:
        if spec.architecture != "encoder-decoder":
            raise RecipeError(f"model: translation trains an encoder-decoder; {spec.name} is {spec.architecture}")

    def add_files(self, files) -> None:
        data = self.recipe.data
        for role in ("train", "validation"):
            pair = getattr(data, role)
            if pair is not None:
                files.own(f"data.{role}.source", pair.source)
                files.own(f"data.{role}.target", pair.target)
            elif data.dataset is not None:
                files.dataset(data.dataset, [files.registry(data.dataset).split_of(role)])


class Translation(TokenBudgetTask):
    name = "translation"
    recipe = TranslationRecipe
    resolution = TranslationResolution
    eval_options = ("src", "ref", "split", "num_beams", "length_penalty", "max_sentences", "output")
    generate_options = ("num_beams",)

    def prepare(self, run, samples: bool):
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.translation.training import prepare

        return prepare(run)

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.translation.training import evaluate

        self.check_meta(meta)
        return evaluate(model, tokenizer, ParallelDataSection, meta, args)

    def generate(self, model, tokenizer, meta: dict, args) -> None:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.translation.training import generate

        self.check_meta(meta)
        print(generate(model, tokenizer, meta, args))


TASK = Translation()
