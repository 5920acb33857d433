"""`builder tokenize SOURCE... -o DATASET --tokenizer TOK`: a corpus into a tokenized dataset.

Text, JSON Lines (also .gz and .zst), Parquet, Arrow and `datasets` save_to_disk folders, or
folders of them, are read as a stream and tokenized by ``--workers`` processes into shards of
``--shard-mb`` MB of text (recipes/data/README.md has the format; `builder train` reads the folder
as a ``data.sources`` entry). Memory stays a few shards per worker whatever the corpus size; a
killed run resumes where it stopped when the same command runs again. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from yamlformer.builder.analysis.report import human_bytes
from yamlformer.builder.cli.arguments import ArgumentError, count, input_path, number, output_folder, text
from yamlformer.builder.spec.loader import SpecError
from yamlformer.recipes.data.dataset_folder import check_output
from yamlformer.recipes.data.sources import DocumentStream, find_sources
from yamlformer.recipes.data.tokenize import matches, tokenize_documents
from yamlformer.recipes.data.tokenized import STARTED, TOKENIZER_FILES
from yamlformer.recipes.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    hf_tokenizer,
    train_sentencepiece,
)
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import recipe_path
from yamlformer.recipes.tasks import load_recipe

#: --workers at most (far above any machine's cores; each worker is a process)
MAX_WORKERS = 1024
#: --shard-mb at most: 64 GiB of text per shard
MAX_SHARD_MB = 1 << 16
#: --shard-mb by default, for a corpus of at least SHARDS_AT_LEAST times that; a smaller corpus is
#: cut into SHARDS_AT_LEAST shards (its size decides, never the number of workers)
DEFAULT_SHARD_MB = 64
SHARDS_AT_LEAST = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        type=input_path,
        help="corpus files or folders: text, .jsonl/.json (also .gz, .zst), .parquet, .arrow, a "
        "`datasets` save_to_disk folder",
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DATASET",
        type=output_folder,
        help="the dataset folder to write (a rerun of the same command resumes it)",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOK",
        help="a sentencepiece .model, a tokenizer.json, a Hugging Face folder, or a recipe (file or "
        "zoo name) whose tokenizer section trains one on the corpus",
    )
    parser.add_argument(
        "--workers",
        type=count(maximum=MAX_WORKERS),
        default=os.cpu_count() or 1,
        help="tokenizing processes, one core each (default: this machine's cores)",
    )
    parser.add_argument(
        "--text-field",
        default="text",
        type=text(maximum=256),
        help="the JSON field or Parquet/Arrow column that holds the text",
    )
    parser.add_argument(
        "--separator",
        type=text(maximum=256),
        help="text files: the string between documents, with \\n, \\t and \\\\ read as escapes "
        "(default: a document per file)",
    )
    parser.add_argument(
        "--val-fraction",
        type=number(minimum=0, below=1),
        default=0.0,
        help="the share of documents held out for validation, chosen by a hash of their text",
    )
    parser.add_argument(
        "--val-sources",
        nargs="+",
        default=[],
        metavar="GLOB",
        help="every document of the source files matching a glob (or under a folder that does) goes "
        "to validation (default: none)",
    )
    parser.add_argument(
        "--shard-mb",
        type=count(maximum=MAX_SHARD_MB),
        help=f"MiB of text per shard, the unit of parallel work and of resuming (default: "
        f"{DEFAULT_SHARD_MB}, or a {SHARDS_AT_LEAST}th of a smaller corpus, at least 1, so that it "
        "still spreads over the workers)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="start over in a DATASET folder begun with other settings"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def unescape(separator: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` as the characters they name; other text as it is."""
    out, i = [], 0
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(separator):
        if separator[i] == "\\" and i + 1 < len(separator) and separator[i + 1] in escapes:
            out.append(escapes[separator[i + 1]])
            i += 2
        else:
            out.append(separator[i])
            i += 1
    return "".join(out)


def shard_mb(given: int | None, sources) -> int:
    """``--shard-mb``, or its default for this corpus (see :data:`DEFAULT_SHARD_MB`)."""
    if given is not None:
        return given
    stored = sum(s.bytes for s in sources) >> 20
    return max(1, min(DEFAULT_SHARD_MB, stored // SHARDS_AT_LEAST))


def run(args: argparse.Namespace) -> int:
    try:
        out = Path(args.output)
        separator = unescape(args.separator) if args.separator is not None else None
        if separator == "":
            raise ArgumentError("--separator: give a non-empty string")
        if not args.text_field:
            raise ArgumentError("--text-field: give a field name")
        check_output(out)
        sources = find_sources(args.sources, exclude=out)
        names = [f.name for s in sources for f in s.files]
        for pattern in args.val_sources:
            if not any(matches(name, [pattern]) for name in names):
                raise ArgumentError(
                    f"--val-sources {pattern!r} matches none of the {len(names):,} source files (e.g. {names[0]})"
                )
        empty = [s.path for s in sources if s.bytes == 0]
        if empty:
            raise RecipeError(f"{empty[0]}: no documents (empty)")
        stream = DocumentStream(sources, args.text_field, separator)
        tokenizer, setting = tokenizer_for(args.tokenizer, stream, out, args.overwrite)
        settings = {"text_field": args.text_field, "separator": separator, **setting}
        dataset = tokenize_documents(
            stream,
            tokenizer,
            out,
            workers=args.workers,
            val_fraction=args.val_fraction,
            shard_bytes=shard_mb(args.shard_mb, sources) << 20,
            sources=[s.entry() for s in sources],
            progress=not args.json,
            val_sources=args.val_sources,
            settings=settings,
            overwrite=args.overwrite,
        )
    except (RecipeError, ArgumentError) as exc:
        print(f"builder tokenize: {exc}", file=sys.stderr)
        return 1
    summary = summarize(dataset, sources)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0


def summarize(dataset, sources) -> dict:
    """What the run made and how fast, as plain data (``--json``)."""
    stats = dataset.stats
    skipped = {s.path: s.skipped for s in sources if s.skipped}
    splits = {}
    for split in ("train", "validation"):
        shards = dataset.manifest["splits"][split]["shards"]
        splits[split] = {
            "documents": dataset.documents(split),
            "tokens": dataset.tokens(split),
            "shards": len(shards),
            "bytes": sum(s["n_tokens"] * dataset.dtype.itemsize + s["n_documents"] * 8 for s in shards),
        }
    tokens = sum(s["tokens"] for s in splits.values())
    seconds = max(stats["seconds"], 1e-9)
    return {
        "dataset": str(dataset.folder),
        "dtype": dataset.dtype.name,
        "eos_id": dataset.eos_id,
        "vocab_size": dataset.vocab_size,
        "tokenizer": dataset.manifest["tokenizer"]["fingerprint"],
        "splits": splits,
        "sources": [
            {
                "path": e["path"],
                "format": e["format"],
                "documents": e["documents"],
                "bytes": e["bytes"],
                "text_bytes": e["text_bytes"],
                "skipped_splits": skipped.get(e["path"], []),
            }
            for e in stats["sources"]
        ],
        "seconds": stats["seconds"],
        "mb_per_s": stats["source_bytes"] / seconds / 1e6,
        "tokens_per_s": tokens / seconds,
        "units": stats["units"],
        "reused_units": stats["reused_units"],
        "tokenized_units": stats["tokenized_units"],
        "replaced_unicode": stats["replaced_unicode"],
    }


def print_summary(summary: dict) -> None:

    # not a terminal (a log, a pipe): wide enough that source paths are printed whole
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 200)
    splits = Table(
        title=f"{summary['dataset']} ({summary['dtype']}, vocabulary {summary['vocab_size']:,}, "
        f"eos {summary['eos_id']})",
        title_justify="left",
    )
    for name in ("split", "documents", "tokens", "shards", "bytes"):
        splits.add_column(name, justify="left" if name == "split" else "right")
    for name, row in summary["splits"].items():
        splits.add_row(
            name, f"{row['documents']:,}", f"{row['tokens']:,}", f"{row['shards']:,}", human_bytes(row["bytes"])
        )
    console.print(splits)
    sources = Table()
    for name in ("source", "format", "documents", "bytes", "text"):
        sources.add_column(
            name,
            justify="left" if name in ("source", "format") else "right",
            overflow="fold" if name == "source" else "ellipsis",
        )
    for row in summary["sources"]:
        skipped = f" (left out: {', '.join(row['skipped_splits'])})" if row["skipped_splits"] else ""
        sources.add_row(
            row["path"] + skipped,
            row["format"],
            f"{row['documents']:,}",
            human_bytes(row["bytes"]),
            human_bytes(row["text_bytes"]),
        )
    console.print(sources)
    reused = ""
    if summary["reused_units"]:
        reused = (
            f"; {summary['reused_units']:,} of {summary['units']:,} shards were already done (a resumed run), "
            f"{summary['tokenized_units']:,} tokenized now"
        )
    replaced = (
        f"; {summary['replaced_unicode']:,} documents had invalid Unicode (lone surrogates), replaced by U+FFFD"
        if summary["replaced_unicode"]
        else ""
    )
    console.print(
        f"{summary['seconds']:,.1f} s, {summary['mb_per_s']:,.1f} MB/s, "
        f"{summary['tokens_per_s'] / 1e6:,.2f}M tokens/s{reused}{replaced}"
    )


# -- the tokenizer a command names -----------------------------------------------------------------

#: text read from the start of the stream to train a recipe's sentencepiece tokenizer on
SAMPLE_BYTES = 64 << 20


def tokenizer_for(argument: str, documents, out: Path, overwrite: bool) -> tuple[object, dict]:
    """``(tokenizer, its setting)`` for ``--tokenizer``: a sentencepiece ``.model``, a
    ``tokenizer.json``, a Hugging Face folder, or a recipe (YAML or zoo name) whose tokenizer
    section says how to make one: sentencepiece trained on the first :data:`SAMPLE_BYTES` of
    ``documents`` (``train_max_lines`` of their lines sampled), a char table of every character
    in them. A tokenizer a run of the same command in ``out`` already made is reused."""
    path = Path(argument)
    if path.is_file() and path.suffix not in (".yaml", ".yml"):
        if path.suffix == ".json":
            return _named(hf_tokenizer, path), {}
        try:
            return SentencePieceTokenizer(path.read_bytes()), {}
        except Exception:
            raise RecipeError(
                f"--tokenizer {argument}: not a sentencepiece model (give a .model, a tokenizer.json, a "
                "Hugging Face folder or a recipe)"
            ) from None
    if path.is_dir():
        return _named(hf_tokenizer, path), {}
    return _from_recipe(argument, documents, out, overwrite)


def _named(read, path: Path):
    try:
        return read(path)
    except RecipeError as exc:
        raise RecipeError(f"--tokenizer {str(exc).removeprefix('tokenizer.model_file: ')}") from None


def _from_recipe(argument: str, documents, out: Path, overwrite: bool) -> tuple[object, dict]:
    try:
        recipe_file = recipe_path(argument)
    except RecipeError:
        raise RecipeError(
            f"--tokenizer {argument}: no such file or folder, nor a zoo recipe (give a .model, a "
            "tokenizer.json, a Hugging Face folder or a recipe)"
        ) from None
    try:
        section = load_recipe(recipe_file).recipe.tokenizer
    except SpecError as exc:
        first = exc.problems[0] if getattr(exc, "problems", None) else exc
        raise RecipeError(f"--tokenizer {argument}: {first}") from None
    setting = {"tokenizer_recipe": section.model_dump(mode="json")}
    made = section.type == "char" or (section.type == "sentencepiece" and section.model_file is None)
    if not made:
        return build_tokenizer(section, "", "", out, recipe_file), setting
    earlier = _earlier_tokenizer(out, setting) if not overwrite else None
    if earlier is not None:
        return earlier, setting
    if section.type == "char":
        chars: set[str] = set()
        for doc in documents:
            chars.update(doc.text)
        return CharTokenizer(sorted(chars)), setting
    sample, size = [], 0
    for doc in documents:
        sample.append(doc.text)
        size += len(doc.text)
        if size >= SAMPLE_BYTES:
            break
    print(
        f"builder tokenize: training a sentencepiece {section.model_type} tokenizer ({section.vocab_size:,} pieces) "
        f"on the first {f'{size / 1e6:,.1f} MB' if size >= 100_000 else f'{size:,} bytes'} of the corpus",
        file=sys.stderr,
        flush=True,
    )
    return SentencePieceTokenizer(train_sentencepiece("\n".join(sample), section)), setting


def _earlier_tokenizer(out: Path, setting: dict):
    """The tokenizer an unfinished or finished run with the same recipe section saved in ``out``."""
    try:
        settings = json.loads((out / STARTED).read_text(encoding="utf-8"))["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if settings.get("tokenizer_recipe") != setting["tokenizer_recipe"]:
        return None
    for kind, name in TOKENIZER_FILES.items():
        path = out / name
        if not path.is_file() or kind == "tokenizers":
            continue
        try:
            tokenizer = (
                SentencePieceTokenizer(path.read_bytes())
                if kind == "sentencepiece"
                else CharTokenizer(list(json.loads(path.read_text(encoding="utf-8"))["chars"]))
            )
        except Exception:
            continue
        if tokenizer.fingerprint() == settings.get("tokenizer"):
            return tokenizer
    return None
