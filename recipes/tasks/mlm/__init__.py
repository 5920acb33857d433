"""``task: mlm``: BERT's masked-LM pretraining on windows of a text corpus, on an encoder-only
spec. This module (torch-free) is its recipe schema and its :class:`~yamlformer.recipes.tasks.task.Task`;
``training.py`` masks, trains and scores."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.data.section import DataSection
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import _Section
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.lm import Corpus, CorpusResolution
from yamlformer.recipes.tasks.task import Task


class MLMSection(_Section):
    mask_prob: float = Field(0.15, gt=0, lt=1, description="Share of the non-special tokens chosen for prediction.")
    replace_mask: float = Field(0.8, ge=0, le=1, description="Of the chosen tokens, the share replaced by [MASK].")
    replace_random: float = Field(
        0.1, ge=0, le=1, description="Of the chosen tokens, the share replaced by a random token (the rest stay)."
    )

    @model_validator(mode="after")
    def _shares(self):
        if self.replace_mask + self.replace_random > 1:
            raise rule_error(
                ("replace_mask",),
                f"replace_mask {self.replace_mask} + replace_random {self.replace_random} exceed 1; "
                "the rest of the chosen tokens stay unchanged",
            )
        return self


class MLMRecipe(Recipe):
    """``task: mlm``: BERT's masked-LM pretraining on windows of a text corpus."""

    splits_windows: ClassVar[bool] = False  # its windows are masked whole, not cut as causal ones

    task: Literal["mlm"] = Field("mlm", description="mlm.")
    data: DataSection = Field(
        default_factory=DataSection, description="The corpus; windows of seq_len tokens, [CLS] and [SEP] included."
    )
    mlm: MLMSection = Field(default_factory=MLMSection, description="Which tokens are masked, and how.")

    @model_validator(mode="after")
    def _mlm_rules(self):
        if self.tokenizer.type != "sentencepiece":
            raise rule_error(
                ("tokenizer", "type"),
                "tokenizer.type: mlm needs a sentencepiece tokenizer ([PAD], [CLS], [SEP], [MASK])",
            )
        if self.data.seq_len < 3:
            raise rule_error(("data", "seq_len"), "data.seq_len must leave room for [CLS], [SEP] and a token (>= 3)")
        return self


def check_encoder(recipe, spec) -> None:
    """Refuse a spec that is not encoder-only (the mlm and classification tasks train encoders)."""
    if spec.architecture != "encoder-only":
        raise RecipeError(f"model: task {recipe.task} trains an encoder-only model; {spec.name} is {spec.architecture}")


class MLMResolution(CorpusResolution):
    def check_spec(self, spec) -> None:
        recipe = self.recipe
        check_encoder(recipe, spec)
        if not type(spec.head).projects_to_vocab:
            raise RecipeError(
                f"model: masked-LM pretraining needs a head of type mlm (or lm), one that projects to "
                f"the vocabulary; {spec.name} has {spec.head.type}"
            )
        if recipe.data.packing != "concat":
            raise RecipeError(
                f"data.packing {recipe.data.packing}: the mlm task frames each window as [CLS] window [SEP]; use concat"
            )
        super().check_spec(spec)


class MaskedLM(Corpus, Task):
    name = "mlm"
    recipe = MLMRecipe
    resolution = MLMResolution
    eval_options = ("max_batches", "all")

    def prepare(self, run, samples: bool):
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.mlm.training import prepare_mlm

        return prepare_mlm(run)

    def corpus_section(self, recipe):
        """The windows two tokens shorter: ``[CLS]`` and ``[SEP]`` are added to each."""
        return recipe.data.model_copy(update={"seq_len": recipe.data.seq_len - 2})

    def trains_tokenizer(self, recipe) -> bool:
        return recipe.tokenizer.model_file is None

    def total_windows(self, recipe) -> int | None:
        return None  # a masked-LM run draws its sources by their tokens, with no epoch limit checked

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        # local: the task's training side imports torch; its recipe and Task here stay torch-free (builder validate)
        from yamlformer.recipes.tasks.mlm.training import evaluate

        self.check_meta(meta)
        return evaluate(model, tokenizer, self.recipe.model_validate(meta["recipe"]), meta, args)


TASK = MaskedLM()
