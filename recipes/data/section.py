"""The ``data`` section of the LM and MLM recipes: where the corpus comes from (a dataset by name,
your text, tokenized datasets, Megatron-LM and nanoGPT token files, mixed by weight), how it is
cut into windows and held out. ``DatasetFields`` is the part every task's data section shares;
``TokenizerSection``, the ``tokenizer`` section every recipe has, is here beside the data it is
trained on, so the tokenizers import no recipe module."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from yamlformer.recipes.fields import PYTHON_STDLIB, RECIPE_PATH, WORK_PATH, _Section, default_cache_dir, resolve


class SourceEntry(_Section):
    """One source of the corpus with its share of the mixture (a plain string in ``sources`` is
    one of these with its path only)."""

    path: str = Field(
        ...,
        description="A `builder tokenize` output folder, a Megatron-LM dataset (its path prefix, or the "
        ".bin or .idx file), a raw token file (.bin, nanoGPT's format), a text file or folder, or a dataset name.",
        json_schema_extra=RECIPE_PATH,
    )
    weight: float | None = Field(
        None,
        gt=0,
        description="Its share of the training windows, relative to the other sources' weights "
        "(give every source a weight or none: none draws each in proportion to its tokens).",
    )
    max_epochs: float | None = Field(
        None,
        gt=0,
        description="The most passes over this source the run may make (`--dry-run` warns and "
        "`train` refuses past it; null: no limit).",
    )
    validation: str | None = Field(
        None,
        description="Held-out tokens for this source, in the same format (nanoGPT's val.bin); default: "
        "a tokenized dataset's own validation split, else data.val_fraction of the documents.",
        json_schema_extra=RECIPE_PATH,
    )
    dtype: Literal["uint16", "uint32", "int32"] = Field(
        "uint16",
        description="A raw .bin token file's integer type (nanoGPT writes uint16).",
    )


class DatasetFields(_Section):
    """``dataset`` and ``root``: the fields every data section has for data named in
    :mod:`yamlformer.recipes.data.registry` (downloaded once, verified, reused)."""

    dataset: str | None = Field(
        None,
        description="A dataset by name (recipes/data/registry.py: tinyshakespeare, multi30k, python-stdlib): "
        "fetched once into the data root, checked against its sha256, reused.",
    )
    root: str | None = Field(
        None,
        description="The folder datasets are read from, and downloaded to when missing (relative to the "
        "recipe; null: $BUILDER_DATA, else the user cache, ~/.cache/builder/data on Linux).",
        json_schema_extra=RECIPE_PATH,
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value):
        if value is not None:
            # local: the dataset registry (urllib, http) loads only when a dataset is named
            from yamlformer.recipes.data.registry import get

            get(value)
        return value

    def dataset_root(self, recipe_file: Path | None) -> Path | None:
        """``root`` resolved against the recipe (``None``: the default data root)."""
        return resolve(recipe_file, self.root) if self.root is not None else None


class DataSection(DatasetFields):
    sources: list[SourceEntry] = Field(
        default_factory=list,
        description="What is read after `dataset`, each a path (relative to the recipe) or a mapping with its "
        "weight: text files or folders, a dataset name, `builder tokenize` outputs, Megatron-LM .bin/.idx "
        "datasets, raw token files. With neither: `python-stdlib`, the standard library's own .py source from "
        "the running interpreter.",
        json_schema_extra=RECIPE_PATH,
    )
    include: list[str] = Field(
        default_factory=lambda: ["*.py", "*.txt", "*.md", "*.rst"],
        description="File-name patterns read from folders (files named directly are always read).",
    )
    max_bytes: int | None = Field(
        16_000_000, ge=1, description="Stop reading once the corpus is this large (null: no cap)."
    )
    val_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="The share held out for validation: whole documents, chosen by a hash of "
        "their text, when the text has 20 or more documents, else the stream's tail (default: the dataset's own "
        "split, e.g. tinyshakespeare's last 10%, else 0.1). Tokenized datasets keep their own split.",
    )
    seq_len: int = Field(256, ge=1, description="Tokens per training window.")
    batch_size: int = Field(16, ge=1, description="Windows per micro-batch on each device.")
    packing: Literal["concat", "doc_masked"] = Field(
        "concat",
        description="concat: windows cut from the documents joined by EOS, attending across them | "
        "doc_masked: the same windows, but attention never crosses a document and positions restart at each.",
    )
    num_workers: int = Field(
        1,
        ge=0,
        le=64,
        description="Worker processes that make training batches ahead of the step (0: in the training process).",
    )
    cache_dir: str = Field(
        default_factory=default_cache_dir,
        description="Tokenizers and tokenized corpora, keyed by content hash "
        "(default: the user cache, ~/.cache/builder on Linux; ./.cache/builder where one is left from an earlier "
        "version).",
        json_schema_extra=WORK_PATH,
    )

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source(cls, value):
        value = [value] if isinstance(value, str) else value
        return [{"path": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @field_serializer("sources")
    def _plain_paths(self, sources):
        """A source with its path only is written as the path, as the recipe wrote it."""
        return [s.path if not s.model_fields_set - {"path"} else s.model_dump(exclude_unset=True) for s in sources]

    @field_validator("sources")
    @classmethod
    def _weights_for_all_or_none(cls, sources):
        weighted = [s.weight is not None for s in sources]
        if any(weighted) and not all(weighted):
            missing = [i for i, w in enumerate(weighted) if not w]
            raise ValueError(
                f"sources {missing} have no weight while others do: give every source a weight, "
                "or none (then each is drawn in proportion to its tokens)"
            )
        return sources

    @model_validator(mode="after")
    def _corpus(self):
        if self.dataset is None and not self.sources:
            self.dataset = PYTHON_STDLIB
        if self.dataset is not None and "val_fraction" not in self.model_fields_set:
            # local: the dataset registry (urllib, http) loads only when a dataset is named
            from yamlformer.recipes.data.registry import get

            self.val_fraction = get(self.dataset).val_fraction or self.val_fraction
        return self

    def entries(self) -> list[SourceEntry]:
        """Every source, in order: the dataset by name, then ``sources``."""
        named = [SourceEntry(path=self.dataset)] if self.dataset is not None else []
        return named + list(self.sources)

    def corpus(self) -> list[str]:
        """The paths the corpus reads, in order: the dataset's name, then the sources'."""
        return [entry.path for entry in self.entries()]


class TokenizerSection(_Section):
    type: Literal["sentencepiece", "char", "hf"] = Field(
        "sentencepiece",
        description="sentencepiece (trained on the corpus, or `model_file`) | char | hf: the tokenizer of a "
        "Hugging Face folder or a `builder import-hf` output (`model_file`).",
    )
    model_type: Literal["bpe", "unigram"] = Field("bpe", description="sentencepiece: bpe | unigram.")
    vocab_size: int = Field(4096, ge=16, description="sentencepiece: vocabulary size to train.")
    model_file: str | None = Field(
        None,
        description="sentencepiece: an existing .model file instead of training; hf: the folder (its "
        "tokenizer.json, else tokenizer.model) or a tokenizer.json. Relative to the recipe.",
        json_schema_extra=RECIPE_PATH,
    )
    train_max_lines: int = Field(
        300_000, ge=1, description="sentencepiece: lines of the corpus sampled to train the tokenizer."
    )
