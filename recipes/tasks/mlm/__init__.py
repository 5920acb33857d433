"""``task: mlm``: BERT's masked-LM pretraining on windows of a text corpus, on an encoder-only
spec. This module (torch-free) is its recipe schema and its :class:`~yamlformer.recipes.tasks.task.Task`;
``training.py`` masks, trains and scores."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.data.section import DataSection
from yamlformer.recipes.recipe.fields import _Section
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.lm import Corpus
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


class MaskedLM(Corpus, Task):
    name = "mlm"
    recipe = MLMRecipe
    eval_options = ("max_batches", "all")

    def prepare(self, recipe, recipe_file: Path, samples: bool):
        from yamlformer.recipes.tasks.mlm.training import prepare_mlm

        return prepare_mlm(recipe, recipe_file)

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        from yamlformer.recipes.tasks.mlm.training import evaluate

        self.check_meta(meta)
        return evaluate(model, tokenizer, self.recipe.model_validate(meta["recipe"]), meta, args)


TASK = MaskedLM()
