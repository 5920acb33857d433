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

#: --workers at most (far above any machine's cores; each worker is a process)
MAX_WORKERS = 1024
#: --shard-mb at most: 64 GiB of text per shard
MAX_SHARD_MB = 1 << 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from builder.commands.arguments import (
        count,
        input_path,
        number,
        output_folder,
        text,
    )

    parser.add_argument("sources", nargs="+", metavar="SOURCE", type=input_path,
                        help="corpus files or folders: text, .jsonl/.json (also .gz, .zst), .parquet, .arrow, a "
                        "`datasets` save_to_disk folder")
    parser.add_argument("-o", "--output", required=True, metavar="DATASET", type=output_folder,
                        help="the dataset folder to write (a rerun of the same command resumes it)")
    parser.add_argument("--tokenizer", required=True, metavar="TOK",
                        help="a sentencepiece .model, a tokenizer.json, a Hugging Face folder, or a recipe (file or "
                        "zoo name) whose tokenizer section trains one on the corpus")
    parser.add_argument("--workers", type=count(maximum=MAX_WORKERS), default=os.cpu_count() or 1,
                        help="tokenizing processes, one core each (default: this machine's cores)")
    parser.add_argument("--text-field", default="text", type=text(maximum=256),
                        help="the JSON field or Parquet/Arrow column that holds the text")
    parser.add_argument("--separator", type=text(maximum=256),
                        help="text files: the string between documents, with \\n, \\t and \\\\ read as escapes "
                        "(default: a document per file)")
    parser.add_argument("--val-fraction", type=number(minimum=0, below=1), default=0.0,
                        help="the share of documents held out for validation, chosen by a hash of their text")
    parser.add_argument("--val-sources", nargs="+", default=[], metavar="GLOB",
                        help="every document of the source files matching a glob (or under a folder that does) goes "
                        "to validation (default: none)")
    parser.add_argument("--shard-mb", type=count(maximum=MAX_SHARD_MB), default=64,
                        help="MB of text per shard (the unit of parallel work and of resuming)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a DATASET folder begun with other settings")
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


def run(args: argparse.Namespace) -> int:
    from builder.commands.arguments import ArgumentError
    from recipes.config import RecipeError
    from recipes.data.sources import DocumentStream, find_sources
    from recipes.data.tokenize import (
        check_output,
        matches,
        tokenize_documents,
        tokenizer_for,
    )

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
                raise ArgumentError(f"--val-sources {pattern!r} matches none of the {len(names):,} source files "
                                    f"(e.g. {names[0]})")
        empty = [s.path for s in sources if s.bytes == 0]
        if empty:
            raise RecipeError(f"{empty[0]}: no documents (empty)")
        stream = DocumentStream(sources, args.text_field, separator)
        tokenizer, setting = tokenizer_for(args.tokenizer, stream, out, args.overwrite)
        settings = {"text_field": args.text_field, "separator": separator, **setting}
        dataset = tokenize_documents(
            stream, tokenizer, out, workers=args.workers, val_fraction=args.val_fraction,
            shard_bytes=args.shard_mb << 20, sources=[s.entry() for s in sources], progress=not args.json,
            val_sources=args.val_sources, settings=settings, overwrite=args.overwrite)
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
        splits[split] = {"documents": dataset.documents(split), "tokens": dataset.tokens(split), "shards": len(shards),
                         "bytes": sum(s["n_tokens"] * dataset.dtype.itemsize + s["n_documents"] * 8 for s in shards)}
    tokens = sum(s["tokens"] for s in splits.values())
    seconds = max(stats["seconds"], 1e-9)
    return {
        "dataset": str(dataset.folder), "dtype": dataset.dtype.name, "eos_id": dataset.eos_id,
        "vocab_size": dataset.vocab_size, "tokenizer": dataset.manifest["tokenizer"]["fingerprint"],
        "splits": splits,
        "sources": [{"path": e["path"], "format": e["format"], "documents": e["documents"], "bytes": e["bytes"],
                     "text_bytes": e["text_bytes"], "skipped_splits": skipped.get(e["path"], [])}
                    for e in stats["sources"]],
        "seconds": stats["seconds"], "mb_per_s": stats["source_bytes"] / seconds / 1e6,
        "tokens_per_s": tokens / seconds, "units": stats["units"], "reused_units": stats["reused_units"],
        "tokenized_units": stats["tokenized_units"], "replaced_unicode": stats["replaced_unicode"],
    }


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from builder.report import human_bytes

    # not a terminal (a log, a pipe): wide enough that source paths are printed whole
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 200)
    splits = Table(title=f"{summary['dataset']} ({summary['dtype']}, vocabulary {summary['vocab_size']:,}, "
                   f"eos {summary['eos_id']})", title_justify="left")
    for name in ("split", "documents", "tokens", "shards", "bytes"):
        splits.add_column(name, justify="left" if name == "split" else "right")
    for name, row in summary["splits"].items():
        splits.add_row(name, f"{row['documents']:,}", f"{row['tokens']:,}", f"{row['shards']:,}",
                       human_bytes(row["bytes"]))
    console.print(splits)
    sources = Table()
    for name in ("source", "format", "documents", "bytes", "text"):
        sources.add_column(name, justify="left" if name in ("source", "format") else "right",
                           overflow="fold" if name == "source" else "ellipsis")
    for row in summary["sources"]:
        skipped = f" (left out: {', '.join(row['skipped_splits'])})" if row["skipped_splits"] else ""
        sources.add_row(row["path"] + skipped, row["format"], f"{row['documents']:,}", human_bytes(row["bytes"]),
                        human_bytes(row["text_bytes"]))
    console.print(sources)
    reused = ""
    if summary["reused_units"]:
        reused = (f"; {summary['reused_units']:,} of {summary['units']:,} shards were already done (a resumed run), "
                  f"{summary['tokenized_units']:,} tokenized now")
    replaced = (f"; {summary['replaced_unicode']:,} documents had invalid Unicode (lone surrogates), replaced by "
                "U+FFFD" if summary["replaced_unicode"] else "")
    console.print(f"{summary['seconds']:,.1f} s, {summary['mb_per_s']:,.1f} MB/s, "
                  f"{summary['tokens_per_s'] / 1e6:,.2f}M tokens/s{reused}{replaced}")
