"""`builder sweep STUDY.yaml`: run a study's variants as `builder train` runs, results in its database.

Every variant is checked before any trial starts (its fields, its spec, its exact FLOPs per token,
which set its steps under a FLOP budget); one that cannot run is named in one line and the study
goes on without it. Running the command again resumes the study: finished trials are not run
again and interrupted ones resume from their checkpoints. ``--print-slurm`` and
``--print-torchrun`` print the launch lines instead of running anything.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import optuna
from rich.console import Console
from rich.table import Table

from yamlformer.builder.analysis.sbatch import activation
from yamlformer.builder.cli.arguments import count
from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.studies import store
from yamlformer.recipes.studies.runner import Sweep, queue_grid
from yamlformer.recipes.studies.schema import load_study
from yamlformer.recipes.studies.store import check_storage
from yamlformer.recipes.studies.variants import NothingToRun, plan, train_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", metavar="STUDY", help="a study file (recipes/README.md, 'Variant studies')")
    show = parser.add_mutually_exclusive_group()
    show.add_argument(
        "--dry-run", action="store_true", help="check and list the variants (parameters, FLOPs, steps); run nothing"
    )
    show.add_argument(
        "--print-slurm",
        action="store_true",
        help="print an sbatch array job whose tasks each run one trial of the study (its storage shared); run nothing",
    )
    show.add_argument(
        "--print-torchrun",
        action="store_true",
        help="print each variant's `builder train` line (under torchrun for several devices); run nothing",
    )
    parser.add_argument(
        "--max-trials",
        type=count(minimum=0),
        metavar="N",
        help="this worker runs at most N trials, then stops; 0 makes the study (its grid queued) and runs none "
        "(default: all)",
    )
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="run again the variants whose trial failed with an error (default: a failed trial stays failed)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (SpecError, NothingToRun) as exc:  # located lines, as they are
        print(exc, file=sys.stderr)
        return 1
    except RecipeError as exc:
        print(f"builder sweep: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    loaded = load_study(args.study)
    if not (args.dry_run or args.print_torchrun or args.print_slurm):
        check_storage(loaded)  # a server without its driver is said now, not after every variant is checked
    variants, invalid = plan(loaded, progress=True)
    for bad in invalid:
        lines = bad.error.splitlines()
        print(f"{loaded.path}: variant {bad.name} cannot run: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(f"  {line}", file=sys.stderr)
    if args.dry_run:
        _print_plan(loaded, variants)
        return 0
    if args.print_torchrun or args.print_slurm:
        print(_launch_lines(loaded, variants, slurm=args.print_slurm))
        return 0
    return _sweep(loaded, variants, invalid, args)


def _sweep(loaded, variants, invalid, args) -> int:
    settings = loaded.study
    study, created = store.open_study(loaded, create=True, sampler=_sampler(settings), pruner=_pruner(settings))
    if created and settings.search == "grid":
        queue_grid(study, variants, invalid)
    resumed = store.recover(study)
    retried = store.retry_failed(study) if args.retry_failed else 0
    where = loaded.storage
    done = sum(1 for t in store.latest_trials(study) if store.status(t) in ("complete", "pruned"))
    print(
        f"study {loaded.name}: {len(variants)} variants, {settings.search}; "
        f"{'new' if created else 'resumed'} in {where}"
        + (f"; {done} finished already" if done else "")
        + (f"; {resumed} interrupted trials resume" if resumed else "")
        + (f"; {retried} failed trials run again" if retried else ""),
        flush=True,
    )
    code = Sweep(loaded, variants, study, args.max_trials).run()
    counts: dict[str, int] = {}
    for trial in store.latest_trials(study):
        counts[store.status(trial)] = counts.get(store.status(trial), 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    again = f"; `builder sweep {loaded.path} --retry-failed` runs the failed again" if counts.get("failed") else ""
    print(f"study {loaded.name}: {summary}; `builder study report {loaded.path}` shows them{again}", flush=True)
    if code:
        print(f"stopped; `builder sweep {loaded.path}` resumes it", flush=True)
    return code


def _sampler(settings):
    if settings.search == "tpe":
        return optuna.samplers.TPESampler(seed=settings.seed)
    return optuna.samplers.RandomSampler(seed=settings.seed)  # a grid's trials are all queued


def _pruner(settings):
    pruner = settings.pruner
    if pruner is None or pruner.type == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=pruner.min_trials, n_warmup_steps=pruner.warmup)


def _print_plan(loaded, variants) -> None:
    table = Table(title=f"{loaded.name}: {len(variants)} variants", title_justify="left")
    for column in ("variant", "params", "FLOPs/token", "tokens/step", "steps", "tokens", "FLOPs"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for v in variants:
        table.add_row(
            v.name,
            f"{v.params:,}",
            f"{v.flops_per_token:,}",
            f"{v.tokens_per_step:,}",
            f"{v.steps:,}" if v.steps is not None else "-",
            f"{v.tokens:,}" if v.tokens is not None else "-",
            f"{v.flops:.3g}" if v.flops is not None else "-",
        )
    Console().print(table)


def _launch_lines(loaded, variants, slurm: bool) -> str:
    settings = loaded.study
    devices = settings.parallel.devices
    if not slurm:
        return "\n".join(shlex.join(train_command(loaded, v, devices, python="builder")) for v in variants)
    study = shlex.quote(str(loaded.path.resolve()))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={loaded.name}",
        f"#SBATCH --array=0-{len(variants) - 1}%{settings.parallel.trials}",
        "#SBATCH --ntasks=1",
        "#SBATCH --output=%x-%A_%a.out",
        "#SBATCH --open-mode=append",
    ]
    if devices:
        lines.append(f"#SBATCH --gpus-per-task={devices}")
    lines += [
        f"# each array task claims the next waiting trial of study {loaded.name} in {loaded.storage}",
        "# and runs it as `builder train` in its own run folder; the results go to that database",
    ]
    if loaded.storage.startswith("sqlite:"):
        lines.append("# SQLite locks badly over network filesystems: for many nodes set storage: to a server URL")
    lines.append(f"# make the study once before submitting: builder sweep {study} --max-trials 0")
    lines.append(activation())  # `builder` on every node: the environment this command ran in
    lines.append(f"builder sweep {study} --max-trials 1")
    return "\n".join(lines)
