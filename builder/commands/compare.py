"""``builder compare SPEC``: build the model on the meta device and set the estimated parameter
counts against the built ones, component by component. Exit 0 when every one is equal, 1 else.
"""

from __future__ import annotations

import argparse
import json

from builder.commands.common import add_spec_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file (YAML)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_spec_options(parser)


def compare(spec) -> dict:
    """``{"estimated", "actual", "match", "components": [...]}`` for a loaded spec."""
    from builder.assemble import build_model
    from builder.estimates import estimate
    from builder.report import actual_params, compare_rows

    est = estimate(spec, seq_len=1)
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
    from builder.commands.common import spec_from_args

    spec = spec_from_args(args)
    result = compare(spec)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{result['name']}: estimated vs built (meta device)", title_justify="left")
        for column in ("component", "estimated", "built", "difference", ""):
            table.add_column(column, justify="left" if column == "component" else "right")
        for row in result["components"]:
            mark = "[green]ok[/]" if row["match"] else "[red]DIFF[/]"
            table.add_row(row["component"], f"{row['estimated']:,}", f"{row['actual']:,}",
                          f"{row['difference']:+,}", mark)
        mark = "[green]ok[/]" if result["match"] else "[red]DIFF[/]"
        table.add_row("total", f"{result['estimated']:,}", f"{result['actual']:,}",
                      f"{result['actual'] - result['estimated']:+,}", mark, style="bold")
        Console().print(table)
    return 0 if result["match"] else 1
