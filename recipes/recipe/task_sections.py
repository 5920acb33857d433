"""The recipe schemas of the tasks other than language modelling. Torch-free.

A recipe's ``task`` picks its schema (``recipes.recipe.sections.TASKS``): each task below is a
:class:`~recipes.recipe.sections.Recipe` whose ``data`` section reads that task's data, plus the task's
own settings. Everything else (model, tokenizer, optimizer, schedule, loss, trainer) means what
it means for the language model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from builder.spec.problems import rule_error
from recipes.recipe.fields import default_cache_dir
from recipes.recipe.sections import RECIPE_PATH, WORK_PATH, DataSection, DatasetFields, Recipe, _Section


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
        from recipes.data.registry import get

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
            from recipes.data.registry import get

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
