"""``builder schema [--recipe]``: the JSON Schema (draft-07) of a spec, or of a recipe, for
editors' YAML language servers.

Save it with ``builder schema > spec.schema.json`` (``builder schema --recipe >
recipe.schema.json``) and put ``# yaml-language-server: $schema=spec.schema.json`` (a path
relative to the YAML file, or a URL) on the first line of a file. The schema follows the
registry, plugins included (``--plugin``); how it is made: ``yamlformer.builder.spec.json_schema``.
"""

from __future__ import annotations

import argparse
import json

from yamlformer.builder.cli.arguments import count
from yamlformer.builder.cli.common import add_spec_options, load_plugins_from_args
from yamlformer.builder.kinds import kinds
from yamlformer.builder.spec.json_schema import spec_json_schema  # noqa: F401  (the command's Python form)
from yamlformer.builder.spec.plugins import PluginError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipe",
        action="store_true",
        help="the schema of a training recipe (every task), with the spec's inside model",
    )
    parser.add_argument(
        "--indent", type=count(minimum=0, maximum=16), default=2, help="JSON indentation, 0 to 16 (default 2)"
    )
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    try:
        load_plugins_from_args(args)
    except PluginError as exc:
        print(f"error: {exc}")
        return 1
    kind = kinds().get("recipe" if args.recipe else "spec")
    if kind is None:
        print("error: no recipe kind: the recipes package is not installed")
        return 1
    print(json.dumps(kind.schema(), indent=args.indent))
    return 0
