"""`builder study show|report|fit STUDY`: a study's trials as a table, its report and plots, its scaling-law fit.

``show`` prints the table of trials (the values that vary, parameters, FLOPs, tokens, final and
best validation loss, wall time, status; ``*`` marks the Pareto front of loss against compute).
``report`` prints it too and writes the plots and CSV/JSON exports (default ``STUDY_OUTPUT/report``).
``fit`` fits Chinchilla's ``L(N, D) = E + A/N^alpha + B/D^beta`` with bootstrap intervals and
answers, for a compute budget, the compute-optimal parameters and tokens and the study's spec
nearest to it; ``--predict`` gives the loss of any variant at any token count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from yamlformer.builder.analysis.hardware import Cluster
from yamlformer.builder.analysis.hardware import gpu as hardware_gpu
from yamlformer.builder.analysis.mfu import peak_flops
from yamlformer.builder.analysis.plan import plan
from yamlformer.builder.analysis.report import human
from yamlformer.builder.cli.arguments import count, number, output_file
from yamlformer.builder.spec.loader import parse_set_args
from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.studies import report, scaling, store
from yamlformer.recipes.studies.schema import load_study
from yamlformer.recipes.studies.variants import axis_values, budget_axis, check, step_shape, variant_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="the table of trials")
    report = actions.add_parser("report", help="the table, the Pareto front, plots (PNG) and CSV/JSON exports")
    fit = actions.add_parser("fit", help="Chinchilla's scaling law fitted to the trials; compute-optimal models")
    for sub in (show, report, fit):
        sub.add_argument("study", metavar="STUDY", help="a study file run by `builder sweep`")
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    report.add_argument(
        "--out", metavar="DIR", help="where the plots and exports go (default: the study's output_dir/report)"
    )
    report.add_argument(
        "--csv", metavar="FILE", type=output_file, help="also write the rows here (default: DIR/trials.csv)"
    )
    budget = fit.add_mutually_exclusive_group()
    budget.add_argument(
        "--flops", type=number(above=0), metavar="C", help="a compute budget in training FLOPs (default: none)"
    )
    budget.add_argument(
        "--gpu-hours",
        type=number(above=0),
        metavar="H",
        help="a compute budget in GPU-hours on --gpus GPUs: each study model's tokens are H x 3600 x "
        "builder plan's predicted tokens/s on them (its fastest layout), or with --mfu H x 3600 x the "
        "GPU's peak x MFU FLOPs (default: none)",
    )
    fit.add_argument(
        "--gpu", default="H100 SXM", help="the GPU of --gpu-hours, as builder plan names it (default: H100 SXM)"
    )
    fit.add_argument(
        "--gpus",
        type=count(minimum=1, maximum=65536),
        default=8,
        help="the GPUs --gpu-hours runs on, 8 to a node (default: 8)",
    )
    fit.add_argument(
        "--mfu",
        type=number(above=0, maximum=1),
        help="a fixed MFU for --gpu-hours instead of builder plan's prediction per model (default: the prediction)",
    )
    fit.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "tf32", "fp32"),
        default="bf16",
        help="the peak of --gpu-hours (default: bf16)",
    )
    fit.add_argument(
        "--predict",
        nargs="+",
        metavar="KEY=VALUE",
        help="a variant of the study's base recipe (--set values over the study's set) whose loss to predict",
    )
    fit.add_argument("--tokens", type=number(above=0), help="the tokens --predict trains on (default: its budget's)")
    fit.add_argument(
        "--bootstrap", type=count(minimum=0, maximum=10000), default=200, help="bootstrap resamples (default: 200)"
    )
    fit.add_argument(
        "--max-flops", type=number(above=0), metavar="C", help="fit only the trials of at most C FLOPs (default: all)"
    )
    fit.add_argument(
        "--max-tokens",
        type=number(above=0),
        metavar="D",
        help="the tokens of one pass over the corpus: the study's spec for a budget is picked among the models "
        "that would not repeat it, since the law takes every token as fresh (default: no limit)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return {"show": _show, "report": _report, "fit": _fit}[args.action](args)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 1
    except (RecipeError, ValueError) as exc:
        print(f"builder study {args.action}: {exc}", file=sys.stderr)
        return 1


def _table(args):
    loaded = load_study(args.study)
    study, _ = store.open_study(loaded, create=False)
    return loaded, report.rows(loaded, study)


def _show(args) -> int:
    loaded, table = _table(args)
    if args.json:
        print(json.dumps({"study": loaded.name, "trials": table}, default=str))
    else:
        report.print_table(loaded, table)
    return 0


def _report(args) -> int:
    loaded, table = _table(args)
    folder = Path(args.out) if args.out else loaded.root / "report"
    csv_path = Path(args.csv) if args.csv else folder / "trials.csv"
    report.export(loaded, table, csv_path, folder / "trials.json")
    plots = report.plot(loaded, table, folder)
    front = report.pareto(table)
    if args.json:
        print(json.dumps({"study": loaded.name, "pareto": [r["trial"] for r in front], "plots": list(map(str, plots))}))
        return 0
    report.print_table(loaded, table)
    if front:
        print("Pareto front (loss vs FLOPs): " + ", ".join(f"{r['variant']} {r['final_val']:.4f}" for r in front))
    print(f"wrote {csv_path}, {folder / 'trials.json'}" + "".join(f", {p}" for p in plots))
    return 0


def _fit(args) -> int:
    loaded, table = _table(args)
    kept = [r for r in table if args.max_flops is None or (r["flops"] or 0) <= args.max_flops]
    params, tokens, losses = scaling.study_points(kept)
    fitted = scaling.fit(params, tokens, losses, bootstrap=args.bootstrap)
    law, result = fitted.law, {"points": fitted.points, "law": fitted.law.to_dict(), "intervals": fitted.intervals()}
    if args.max_tokens is not None:
        result["max_tokens"] = args.max_tokens
    compute, members = _compute(args), _members(table)
    if args.gpu_hours is not None and args.mfu is None:
        members = _planned(loaded, table, members, args)
        best = scaling.best_member(law, members, None, args.max_tokens)
        compute = best["compute"]  # what the chosen model's predicted step makes of the GPU-hours
    elif compute is not None:
        best = scaling.best_member(law, members, compute, args.max_tokens)
    if compute is not None:
        n_opt, d_opt = law.optimal(compute)
        result["budget"] = {
            "flops": compute,
            "params": n_opt,
            "tokens": d_opt,
            "loss": float(law.loss(n_opt, d_opt)),
            "params_interval": fitted.interval(lambda fit_law: fit_law.optimal(compute)[0]),
            "tokens_interval": fitted.interval(lambda fit_law: fit_law.optimal(compute)[1]),
            "loss_interval": fitted.interval(lambda fit_law: fit_law.loss(*fit_law.optimal(compute))),
            "nearest": {
                **best,
                "interval": fitted.interval(lambda fit_law: fit_law.loss(best["params"], best["tokens"])),
            },
        }
    if args.predict:
        result["prediction"] = _prediction(loaded, args, fitted)
    if args.json:
        print(json.dumps(result, default=float))
    else:
        _print_fit(result, fitted)
    return 0


def _compute(args) -> float | None:
    """The budget in FLOPs: ``--flops``, or ``--gpu-hours`` at a fixed ``--mfu`` (None otherwise)."""
    if args.flops is not None:
        return args.flops
    if args.gpu_hours is None or args.mfu is None:
        return None
    peak = peak_flops(args.gpu, args.dtype)
    if peak is None:
        raise ValueError(f"--gpu {args.gpu!r}: no peak FLOP/s known for it (builder plan's GPUs: H100 SXM, A100, ...)")
    return args.gpu_hours * 3600 * peak * args.mfu


def _planned(loaded, table: list[dict], members: list[dict], args) -> list[dict]:
    """Each study model with the FLOPs ``--gpu-hours`` buys it on ``--gpus`` GPUs: ``builder
    plan``'s fastest layout for its recipe's sequence length and global batch (rounded up to a
    multiple of the GPUs), its predicted tokens/s per GPU x the hours x its FLOPs per token. A
    model no layout fits is left out (said on stderr); none fitting is a ValueError."""
    row = hardware_gpu(args.gpu)
    peak = row.peak.get(args.dtype)
    if peak is None:
        raise ValueError(f"--dtype {args.dtype}: no {row.name} peak for it ({', '.join(row.peak)})")
    cluster = Cluster(
        gpus=args.gpus, per_node=min(args.gpus, 8), memory=row.memory, peak=peak, gpu=row.name, hardware=row
    )
    axes = [axis for axis in axis_values(loaded) if axis != budget_axis(loaded)]
    out = []
    for member in members:
        trial = next(r for r in table if r["params"] == member["params"])
        resolution, spec, _ = variant_model(loaded, {axis: trial[axis] for axis in axes})
        seq_len, _, sequences = step_shape(resolution, spec)
        found = plan(
            spec, cluster, seq_len=seq_len, global_batch=-(-sequences // args.gpus) * args.gpus, dtype=args.dtype
        )
        if not found.fits:
            print(
                f"{member['family'] or member['params']}: no layout fits {args.gpus} x {row.name}; left out",
                file=sys.stderr,
            )
            continue
        step = found.chosen.prediction
        tokens = args.gpu_hours * 3600 * args.gpus * step.tokens_per_s_per_gpu
        out.append(
            {**member, "compute": tokens * member["flops_per_token"], "mfu": step.mfu, "layout": found.chosen.summary()}
        )
    if not out:
        raise ValueError(f"--gpu-hours: no model of the study fits {args.gpus} x {row.name}")
    return out


def _members(table: list[dict]) -> list[dict]:
    """The study's distinct models: parameters, FLOPs per token, family (named by its best tuning,
    ``scaling.best_tuned``)."""
    return [{k: row[k] for k in ("params", "flops_per_token", "family")} for row in scaling.best_tuned(table).values()]


def _prediction(loaded, args, fitted) -> dict:
    variant = check(loaded, parse_set_args(args.predict))
    tokens = args.tokens or variant.tokens
    return {
        "variant": " ".join(args.predict),
        "params": variant.params,
        "flops_per_token": variant.flops_per_token,
        "tokens": tokens,
        "flops": tokens * variant.flops_per_token,
        "loss": float(fitted.law.loss(variant.params, tokens)),
        "interval": fitted.interval(lambda law: law.loss(variant.params, tokens)),
    }


def _print_fit(result: dict, fitted) -> None:
    print(
        f"L(N, D) = E + A / N^alpha + B / D^beta fitted to {result['points']} runs (the best final loss per "
        f"parameters and tokens; Huber delta 1e-3 on log loss, L-BFGS from a grid), "
        f"95% intervals from {len(fitted.boot)} bootstrap resamples:"
    )
    for name, value in result["law"].items():
        low, high = result["intervals"][name]
        print(f"  {name:<6} {value:>12.4g}   [{low:.4g}, {high:.4g}]")
    budget = result.get("budget")
    if budget:
        (pl, ph), (tl, th), (ll, lh) = budget["params_interval"], budget["tokens_interval"], budget["loss_interval"]
        print(
            f"compute {budget['flops']:.3g} FLOPs (C = 6ND): {human(budget['params'])} parameters "
            f"[{human(pl)}, {human(ph)}], {human(budget['tokens'])} tokens [{human(tl)}, {human(th)}], "
            f"loss {budget['loss']:.4f} [{ll:.4f}, {lh:.4f}]"
        )
        near = budget["nearest"]
        low, high = near["interval"]
        within = f" within {human(result['max_tokens'])} tokens" if result.get("max_tokens") else ""
        print(
            f"  the study's spec for it{within}: {near['family'] or 'its model'} ({near['params']:,} parameters, "
            f"{near['flops_per_token']:,} FLOPs/token): {human(near['tokens'])} tokens, predicted loss "
            f"{near['predicted']:.4f} [{low:.4f}, {high:.4f}]"
        )
        if "mfu" in near:
            print(f"  builder plan's step for it: {near['layout']}, MFU {near['mfu']:.1%}")
    prediction = result.get("prediction")
    if prediction:
        low, high = prediction["interval"]
        print(
            f"{prediction['variant']}: {prediction['params']:,} parameters at {human(prediction['tokens'])} tokens "
            f"({prediction['flops']:.3g} FLOPs): predicted loss {prediction['loss']:.4f} [{low:.4f}, {high:.4f}]"
        )
