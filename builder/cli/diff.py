"""``builder diff A.yaml B.yaml``: the fields that differ and what the change does.

Fields are compared after ``extends`` and defaults are resolved (so ``n_kv_heads`` left out and
``n_kv_heads`` set to ``n_heads`` are the same), as dotted paths. The effect is the estimate of
each: parameters, FLOPs per token and memory, absolute and in percent of A, both at one sequence
length, said with the table: ``--seq-len``, else the shorter ``max_seq_len`` of the two (a
longer window alone would make the change look like attention's cost: llama2-7b to mistral-7b
read +104% FLOPs at 4,096 against 32,768 tokens, +6.55% at 4,096 for both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from yamlformer.builder.analysis.report import MISSING, diff_table
from yamlformer.builder.cli.common import add_spec_options, spec_from_args
from yamlformer.builder.cli.describe import add_estimate_options, estimate_from_args
from yamlformer.builder.parametrization import describe_lines, summary

#: (quantity, estimate attribute path, unit) in the order they are reported
EFFECTS = (
    ("params.total", "params.total", "count"),
    ("params.embedding", "params.embedding", "count"),
    ("params.active", "params.active", "count"),
    ("flops.forward_per_token", "flops.forward_per_token", "count"),
    ("flops.train_per_token", "flops.train_per_token", "count"),
    ("memory.training_total", "memory.training_total", "bytes"),
    ("memory.activations", "memory.activations", "bytes"),
    ("memory.kv_cache", "memory.kv_cache", "bytes"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec_a", metavar="A", help="the spec before: a file or a zoo name")
    parser.add_argument("spec_b", metavar="B", help="the spec after: a file or a zoo name")
    add_estimate_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_spec_options(parser)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as ``{"decoder.attention.n_heads": 32, "x.overrides.0.layers": ...}``."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and value:
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def field_differences(spec_a, spec_b) -> list[tuple[str, Any, Any]]:
    """``(dotted path, value in A, value in B)`` for every resolved field that differs."""
    a = flatten(spec_a.model_dump(exclude={"extends"}))
    b = flatten(spec_b.model_dump(exclude={"extends"}))
    paths = list(a) + [p for p in b if p not in a]
    pairs = ((p, a.get(p, MISSING), b.get(p, MISSING)) for p in paths)
    return [(p, value_a, value_b) for p, value_a, value_b in pairs if value_a != value_b]


def effects(est_a, est_b) -> list[dict[str, Any]]:
    rows = []
    for quantity, path, unit in EFFECTS:
        a, b = _get(est_a, path), _get(est_b, path)
        rows.append(
            {
                "quantity": quantity,
                "unit": unit,
                "a": a,
                "b": b,
                "change": b - a,
                "percent": (100.0 * (b - a) / a) if a else None,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    spec_a = spec_from_args(args, args.spec_a)
    spec_b = spec_from_args(args, args.spec_b)
    shorter = min(spec_a, spec_b, key=lambda spec: spec.max_seq_len)
    seq_len = args.seq_len or shorter.max_seq_len
    at = argparse.Namespace(**{**vars(args), "seq_len": seq_len})
    try:
        est_a, est_b = estimate_from_args(spec_a, at), estimate_from_args(spec_b, at)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    fields = field_differences(spec_a, spec_b)
    rows = effects(est_a, est_b)
    where = "--seq-len" if args.seq_len else f"the shorter max_seq_len, {shorter.name}'s; --seq-len sets another"
    if args.json:
        print(
            json.dumps(
                {
                    "a": {"path": args.spec_a, "name": spec_a.name, "seq_len": est_a.flops.seq_len},
                    "b": {"path": args.spec_b, "name": spec_b.name, "seq_len": est_b.flops.seq_len},
                    "seq_len": seq_len,
                    "seq_len_from": "--seq-len" if args.seq_len else "the shorter max_seq_len",
                    "fields": [{"path": p, "a": _jsonable(a), "b": _jsonable(b)} for p, a, b in fields],
                    "effects": rows,
                    "parametrization": {"a": summary(spec_a), "b": summary(spec_b)},
                },
                indent=2,
            )
        )
    else:
        label_a, label_b = Path(args.spec_a).name, Path(args.spec_b).name
        if label_a == label_b:
            label_a, label_b = f"A: {label_a}", f"B: {label_b}"
        Console().print(diff_table(fields, rows, label_a, label_b, f"both at seq_len {seq_len:,} ({where})"))
        shown_a, shown_b = describe_lines(spec_a), describe_lines(spec_b)
        if shown_a != shown_b:  # what each parametrization makes of its width
            Console().print("\n".join([f"{label_a}:", *shown_a, f"{label_b}:", *shown_b]), highlight=False)
    return 0


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _jsonable(value):
    return None if value is MISSING else value
