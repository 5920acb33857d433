"""``task: sft``: supervised fine-tuning of a causal LM on instruction or chat records, the loss on
the answers only (``yamlformer.recipes.data.chat``), records packed into rows with document masking
(``yamlformer.recipes.data.instructions``); usually from trained weights (``model.init_from``) with
adapters (``model.adapters``: LoRA, DoRA, QLoRA). Held-out prompts are scored before and after.
This module (torch-free) is its recipe schema and :class:`~yamlformer.recipes.tasks.task.Task`;
``training.py`` reads, trains and scores."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.data.section import DatasetFields
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import RECIPE_PATH, WORK_PATH, _Section, default_cache_dir
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.task import Resolution, Task, Vocabulary, scored


def training_file(description: str):
    """The ``data.file`` field: ``description`` of what it holds, a path relative to the recipe."""
    return Field(None, description=f"{description} (relative to the recipe).", json_schema_extra=RECIPE_PATH)


def held_out_file(what: str):
    """The ``data.validation`` field of a data section whose training file holds ``what`` (records, pairs)."""
    return Field(
        None,
        description=f"Held-out {what} like `file` (null: data.val_fraction of the training {what}).",
        json_schema_extra=RECIPE_PATH,
    )


class InstructionDataSection(DatasetFields):
    file: str | None = training_file(
        'Training records: a .jsonl (.gz, .zst) or .parquet file of {"prompt", "response"} (and "system") or '
        '{"messages": [{"role", "content"}, ...]} records'
    )
    validation: str | None = held_out_file("records")
    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="The share of records held out when there is no validation file."
    )
    limit: int | None = Field(None, ge=1, description="Read only the first this many records (null: all).")
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template (Hugging Face's format) to render records with (null: the "
        "tokenizer's own, from its folder's tokenizer_config.json or chat_template.jinja; else a plain default).",
    )
    seq_len: int = Field(512, ge=2, description="Tokens per row; a record longer than this is refused.")
    batch_size: int = Field(8, ge=1, description="Rows per micro-batch on each device.")
    packing: bool = Field(
        True,
        description="Pack several records into a row, attention masked between them and positions restarted "
        "(false: one record a row, padded).",
    )
    cache_dir: str = Field(
        default_factory=default_cache_dir,
        description="Tokenizers trained for a run without init_from, keyed by content hash (default: the user "
        "cache, ~/.cache/builder on Linux).",
        json_schema_extra=WORK_PATH,
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.file is None) == (self.dataset is None):
            raise rule_error(("file",), "give data.file (a .jsonl or .parquet of records) or data.dataset, not both")
        return self


class HeldOutSection(_Section):
    prompts: int = Field(
        8,
        ge=0,
        le=10_000,
        description="Held-out records whose answers are generated (greedy) before and after training and "
        "compared with their references (exact match); their answers' loss is scored on every held-out row.",
    )
    max_new_tokens: int = Field(64, ge=1, le=65_536, description="Tokens generated per held-out prompt.")


class InstructionRecipe(Recipe):
    """``task: sft``: a causal LM fine-tuned on instruction or chat records."""

    task: Literal["sft"] = Field("sft", description="sft.")
    data: InstructionDataSection = Field(..., description="The records, their template and rows.")
    eval: HeldOutSection = Field(default_factory=HeldOutSection, description="Held-out prompts, before and after.")


class InstructionResolution(Resolution):
    """SFT's files, vocabulary and checks: chat records rendered into rows of a causal LM."""

    def conversations(self):
        """``record -> [conversation, ...]``: what a record trains on, the text a char tokenizer is fitted on."""
        # local: the data side loads when data is read (builder validate and list read none)
        from yamlformer.recipes.tasks.sft.records import one_conversation

        return one_conversation

    @functools.cached_property
    def vocabulary(self) -> Vocabulary | None:
        """A char tokenizer's without ``model.init_from``: the characters of the records as the chat
        template renders them (the table the run fits), not of an LM corpus; None (the generic
        stand-in) while they are not read."""
        located, recipe = self.located, self.recipe
        if recipe.tokenizer.type != "char" or recipe.model.init_from is not None or not self.read_data:
            return None
        # local: reading the records is the data side (validate and list never read them)
        from yamlformer.recipes.tasks.sft.records import record_files, tokenizer_for

        train, _ = record_files(recipe.data, located.file)
        if not train.is_file():
            return None  # not there yet: the stand-in
        size = tokenizer_for(located, train, self.conversations()).vocab_size
        return Vocabulary(size, f"char: the rendered records' {size - 1} distinct characters and end-of-text")

    def add_files(self, files) -> None:
        data = self.recipe.data
        if data.dataset is not None:
            files.dataset(data.dataset, [])
        files.own("data.file", data.file)
        files.own("data.validation", data.validation)

    def batch_shape(self, spec) -> tuple[int, int, str]:
        data = self.recipe.data
        packed = "records packed" if data.packing else "a record each"
        return data.seq_len, data.batch_size, f"{data.batch_size} rows x {data.seq_len} tokens ({packed})"

    def check_spec(self, spec) -> None:
        recipe = self.recipe
        if spec.architecture_config.decoding_stack() is None or spec.architecture != "decoder-only":
            raise RecipeError(f"task sft trains a decoder-only model; the spec is {spec.architecture}")
        if recipe.data.seq_len > spec.max_seq_len:
            raise RecipeError(
                f"data.seq_len {recipe.data.seq_len} is longer than the model's max_seq_len {spec.max_seq_len}; "
                "lower data.seq_len or set model.overrides.max_seq_len"
            )

    def check_data(self, vocab_size: int, pretrained: dict | None) -> None:
        """The records read, rendered and encoded as the run reads them, so that the dry run
        refuses them in the run's line (:func:`~yamlformer.recipes.tasks.sft.records.check_records`)."""
        # local: reading the records is the data side (validate and list never read them)
        from yamlformer.recipes.tasks.sft.records import check_records

        check_records(self.located, pretrained)


class InstructionTuning(Task):
    name = "sft"
    recipe = InstructionRecipe
    resolution = InstructionResolution
    eval_options = ("max_batches", "all", "batch_size")
    generate_options = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")

    def prepare(self, run, samples: bool):
        # local: the training side imports torch and Lightning (this module is torch-free)
        from yamlformer.recipes.tasks.sft.training import prepare

        return prepare(run)

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        # local: the training side imports torch and Lightning (this module is torch-free)
        from yamlformer.recipes.tasks.sft.training import evaluate_checkpoint

        self.check_meta(meta)
        return evaluate_checkpoint(model, tokenizer, meta, args)

    def print_evaluation(self, result: dict, args) -> None:
        print(
            f"{result['checkpoint']} (step {result['step']}) on its held-out records: answers' loss "
            f"{result['loss']:.4f} over {result['tokens']:,} tokens; exact match {result['exact']}/{result['prompts']}"
        )
        print(scored(result["batches"], result["batches_available"], args))

    def generate(self, model, tokenizer, meta: dict, args) -> None:
        # local: the training side imports torch and Lightning (this module is torch-free)
        from yamlformer.recipes.tasks.sft.training import generate

        self.check_meta(meta)
        generate(model, tokenizer, meta, args)


TASK = InstructionTuning()
