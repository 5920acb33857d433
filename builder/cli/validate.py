"""``builder validate FILE...``: every problem of every spec or recipe, one line each, then a summary.

A file is checked as what its keys say it is (``yamlformer.builder.kinds``): a model spec, or a training
recipe (the recipe, then the spec it trains with its overrides). A file or a zoo name.
Exit status 0 when every file is valid, 1 otherwise. Torch-free: this path must stay fast.
"""

from __future__ import annotations

import argparse

from yamlformer.builder.cli.common import add_spec_options, load_plugins_from_args, overrides_from_args
from yamlformer.builder.kinds import kind_of
from yamlformer.builder.spec.kind import KIND as SPEC
from yamlformer.builder.spec.loader import SpecError, locate_file, read_merged
from yamlformer.builder.spec.plugins import PluginError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "specs",
        nargs="+",
        metavar="FILE",
        help="spec or recipe files, or zoo names (each checked as what its keys say it is)",
    )
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    try:
        load_plugins_from_args(args)
        overrides = overrides_from_args(args)
    except PluginError as exc:
        print(f"error: {exc}")
        return 1
    except SpecError as exc:
        print(exc)
        return 1
    bad = n_problems = 0
    for path in args.specs:
        problems = validate_any(path, overrides)
        for problem in problems:
            print(problem)
        bad += bool(problems)
        n_problems += len(problems)
    total = len(args.specs)
    files = "file" if total == 1 else "files"
    if bad:
        print(f"{total - bad} of {total} {files} ok; {n_problems} problem{'s' * (n_problems != 1)} in {bad}")
        return 1
    print(f"{total} {files} ok")
    return 0


def validate_any(path: str, overrides) -> list:
    """The problems of one file, checked as the kind its keys say (a spec when they say nothing)."""
    try:
        found, _ = locate_file(path)
        kind = kind_of(read_merged(found).data) or SPEC
    except SpecError as exc:
        return exc.problems
    return kind.validate(found, overrides)
