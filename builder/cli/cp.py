"""``builder cp NAME FILE``: copy a zoo spec or recipe to edit (as torchtune's ``tune cp`` does).

The copy keeps every comment. A field that names another file by a path relative to the zoo
entry (a spec's ``extends: llama2-7b.yaml``, a recipe's ``model.spec``) would no longer resolve
beside the copy, so it is rewritten to that file's zoo name (``extends: llama2-7b``), which
resolves anywhere. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from yamlformer.builder.kinds import kinds
from yamlformer.builder.zoo import did_you_mean, find, name_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="a zoo spec or recipe by name (`builder list`), e.g. llama3-8b")
    parser.add_argument("dest", metavar="FILE", help="the file to write; a folder: NAME's file name inside it")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists (default: refuse)")


def run(args: argparse.Namespace) -> int:
    entry = find(args.name)
    if entry is None:
        print(
            f"builder cp: no zoo spec or recipe named {args.name!r}{did_you_mean(args.name)} "
            "(`builder list` shows the zoo)",
            file=sys.stderr,
        )
        return 1
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / entry.path.name
    if dest.exists() and not args.force:
        print(f"builder cp: {dest} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    if not dest.parent.is_dir():
        print(f"builder cp: {dest}: the folder {dest.parent} does not exist", file=sys.stderr)
        return 1
    text, changed = rewrite_references(
        entry.path.read_text(encoding="utf-8"), entry.path, kinds()[entry.kind].references
    )
    try:
        dest.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"builder cp: cannot write {dest}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    notes = "".join(f"; {field}: {old} -> {new} (the zoo's)" for field, old, new in changed)
    print(f"copied {entry.kind} {entry.name} to {dest}{notes}")
    return 0


def rewrite_references(text: str, source: Path, fields) -> tuple[str, list[tuple[str, str, str]]]:
    """``text`` (the YAML of ``source``) with each of ``fields`` that holds a path relative to
    ``source`` rewritten to the zoo name of the file it names (its absolute path when that is not
    in the zoo). Returns the new text and ``(field, old, new)`` for each change."""

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    edits = []
    for field in fields:
        node = _node_at(root, field)
        if not isinstance(node, yaml.ScalarNode) or not node.value or Path(node.value).is_absolute():
            continue
        target = source.parent / node.value
        if not target.is_file():
            continue  # already a zoo name (or broken: validate says so)
        new = name_of(target) or str(target.resolve())
        if new != node.value:
            edits.append((node.start_mark.index, node.end_mark.index, _plain(new), ".".join(field), node.value, new))
    for start, end, replacement, *_ in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text, [(field, old, new) for *_, field, old, new in edits]


def _node_at(node, path):
    for key in path:
        if not isinstance(node, yaml.MappingNode):
            return None
        node = next((value for k, value in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
    return node


def _plain(value: str) -> str:
    """``value`` as a YAML scalar: plain when that reads back as the same string, else quoted."""
    return value if re.fullmatch(r"[A-Za-z0-9_./-]+", value) and value[0] not in "-." else json.dumps(value)
