"""``builder list``: the zoo — every shipped spec and recipe by name, with its family, parameter
count and a one-line description. Torch-free.

The family of a spec is the Hugging Face model type it exports to exactly (``builder export-hf``),
else its architecture; a recipe's is its task, and its parameters are its model's (with the
vocabulary its tokenizer will have; ``~`` where that is known only once the data is read). The
export column is the Hugging Face model type a spec, or the model a recipe trains, is written
as (``-``: none; ``builder describe`` says the nearest and why). The description is the first
phrase of the file's header comment.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.report import human
from yamlformer.builder.hf import Unsupported, choose_family
from yamlformer.builder.kinds import kinds
from yamlformer.builder.spec.loader import SpecError
from yamlformer.builder.zoo import entries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kind", choices=("spec", "recipe"), default=None, help="only specs or only recipes (default: both)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON list of objects")
    parser.add_argument(
        "--names", action="store_true", help="print only the names, one a line (what shell completion offers)"
    )


def rows(kind: str | None = None) -> list[dict]:
    """One dict per zoo entry: name, kind, family, export, params, description, path."""
    table = kinds()
    out = []
    for entry in entries().values():
        if kind is not None and entry.kind != kind:
            continue
        try:
            summary = summarize(table[entry.kind], entry.path)
        except (SpecError, ValueError) as exc:  # a broken entry is listed, with why
            summary = {"family": "?", "params": None, "problem": str(exc).splitlines()[0]}
        out.append(
            {
                "name": entry.name,
                "kind": entry.kind,
                "family": summary.get("family", ""),
                "export": summary.get("export"),
                "params": summary.get("params"),
                "params_approximate": bool(summary.get("approximate")),
                "description": description(entry.path),
                "path": str(entry.path),
                **({"problem": summary["problem"]} if "problem" in summary else {}),
            }
        )
    return out


def summarize(kind, path: Path) -> dict:
    """``family``, ``export`` and ``params`` of the model a file describes (its kind's ``model``),
    with the kind's own facts: the family a kind names (a recipe's task), else the Hugging Face
    model type the spec exports to exactly (``export``, None when none does), else its architecture."""
    if kind.model is None:
        return {}
    spec, facts = kind.model(path)
    try:
        export = choose_family(spec)[0].model_type
    except Unsupported:
        export = None
    family = facts.get("family") or export or spec.architecture
    return {**facts, "family": family, "export": export, "params": estimate(spec, seq_len=1).params.total}


def description(path: Path, width: int = 56) -> str:
    """The first phrase of the header comment (parentheses left out): up to the first ': ', '. '
    or ';', then cut at a comma or a word to fit ``width``."""
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# yaml-language-server:"):
            lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\s*\([^()]*\)", "", text)
    phrase = re.split(r":\s|\.\s|;\s|\.$", text, maxsplit=1)[0].strip()
    if len(phrase) > width:
        cut = phrase[:width].rsplit(", ", 1)[0]
        phrase = cut if len(cut) < width else phrase[: width - 3].rsplit(" ", 1)[0] + "..."
    return phrase


def run(args: argparse.Namespace) -> int:
    if args.names:  # read nothing but the zoo's folders: completion asks this at every TAB
        print("\n".join(name for name, entry in entries().items() if args.kind in (None, entry.kind)))
        return 0
    found = rows(args.kind)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    table = Table(
        title="the zoo: `builder describe NAME`, `builder train NAME`, `builder cp NAME my.yaml`", title_justify="left"
    )
    for column, justify in (
        ("name", "left"),
        ("kind", "left"),
        ("family", "left"),
        ("export", "left"),
        ("params", "right"),
        ("description", "left"),
    ):
        table.add_column(column, justify=justify)
    for row in found:
        params = human(row["params"]) if row["params"] is not None else "?"
        params = f"~{params}" if row["params_approximate"] else params
        table.add_row(
            row["name"],
            row["kind"],
            row["family"],
            row.get("export") or "-",
            params,
            row.get("problem") or row["description"],
        )
    Console().print(table)
    return 0
