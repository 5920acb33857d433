"""``builder compare SPEC``: build the model on the meta device and set the estimated parameter
counts against the built ones, component by component. Exit 0 when every one is equal, 1 else.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.layout import LayoutError, layer_tensor_count
from yamlformer.builder.analysis.report import actual_params, compare_rows
from yamlformer.builder.cli.common import add_spec_options, spec_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="a spec file (YAML) or a zoo name (`builder list`)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_spec_options(parser)


#: parameter tensors of the layers compare builds at most (any real model has under 5,000;
#: building on the meta device takes about a third of a millisecond each)
MAX_TENSORS = 50_000


class TooLargeToBuild(ValueError):
    """A spec whose model has more parameter tensors than compare builds."""


def compare(spec) -> dict:
    """``{"estimated", "actual", "match", "components": [...]}`` for a loaded spec; raises
    :class:`TooLargeToBuild` beyond :data:`MAX_TENSORS` parameter tensors."""
    try:
        n_tensors = layer_tensor_count(spec)
    except LayoutError:  # a plugin block that declares no shapes: cannot count before building
        n_tensors = 0
    if n_tensors > MAX_TENSORS:
        raise TooLargeToBuild(
            f"{spec.name}'s layers have {n_tensors:,} parameter tensors, more than the "
            f"{MAX_TENSORS:,} compare builds on the meta device; `builder describe` counts it "
            "without building"
        )
    est = estimate(spec, seq_len=1)
    # local: torch loads only for a model it builds (an absurd spec is refused before: test_absurd_sizes)
    from yamlformer.builder.assemble import build_model

    model = build_model(spec, device="meta")
    actual = actual_params(model)
    rows = compare_rows(est.params.by_component, actual)
    total_actual = sum(actual.values())
    return {
        "name": spec.name,
        "estimated": est.params.total,
        "actual": total_actual,
        "match": total_actual == est.params.total and all(row["match"] for row in rows),
        "components": rows,
    }


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    try:
        result = compare(spec)
    except TooLargeToBuild as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        table = Table(title=f"{result['name']}: estimated vs built (meta device)", title_justify="left")
        for column in ("component", "estimated", "built", "difference", ""):
            table.add_column(column, justify="left" if column == "component" else "right")
        for row in result["components"]:
            mark = "[green]ok[/]" if row["match"] else "[red]DIFF[/]"
            table.add_row(
                row["component"], f"{row['estimated']:,}", f"{row['actual']:,}", f"{row['difference']:+,}", mark
            )
        mark = "[green]ok[/]" if result["match"] else "[red]DIFF[/]"
        table.add_row(
            "total",
            f"{result['estimated']:,}",
            f"{result['actual']:,}",
            f"{result['actual'] - result['estimated']:+,}",
            mark,
            style="bold",
        )
        Console().print(table)
    return 0 if result["match"] else 1
