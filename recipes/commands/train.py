"""`builder train RECIPE`: run a Lightning training recipe (see recipes/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from yamlformer.builder.cli.arguments import count, input_path
from yamlformer.builder.cli.common import add_spec_options, load_plugins_from_args, overrides_from_args
from yamlformer.builder.spec.loader import SpecError
from yamlformer.builder.spec.plugins import PluginError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import recipe_path
from yamlformer.recipes.training.signals import SignalStop, Stopped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe",
        metavar="RECIPE",
        help="a recipe file or a zoo recipe by name (lm-stdlib, shakespeare-char: `builder list`)",
    )
    add_spec_options(parser)
    parser.epilog = (
        "--set trainer.max_steps=10 sets a recipe field; --set decoder.n_layers=2 (short for "
        "--set model.overrides.decoder.n_layers=2) sets a field of the model spec. A relative path "
        "given with --set is read from the working directory when it is there (else from the recipe's "
        "folder, or as a zoo name)."
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve everything (data, tokenizer, spec with its overrides, devices) and check it as "
        "the run does, then print the resolved recipe and the estimate; download, train and write nothing",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CKPT",
        type=input_path,
        help="resume from CKPT (default: the newest intact of the run's last.ckpt, last-1.ckpt "
        "and best.ckpt; a rerun resumes by itself)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start over in the same folder; earlier checkpoints move to checkpoints.before-fresh-TIME",
    )
    parser.add_argument(
        "--cooldown-from",
        metavar="CKPT",
        type=input_path,
        help="branch a cooldown from CKPT, a checkpoint of the stable phase of a schedule.type wsd (or constant) "
        "run (trainer.keep_every_n_steps keeps them): --steps more steps, the learning rate decaying to min_lr, "
        "in the folder RUN-cooldown-STEP+N beside the run's; the same command again resumes it (default: none, "
        "no cooldown)",
    )
    parser.add_argument(
        "--steps",
        type=count(1),
        metavar="N",
        help="with --cooldown-from: the cooldown's length in optimizer steps, an integer from 1 up (default: none; "
        "required with --cooldown-from)",
    )
    parser.add_argument("--no-samples", dest="samples", action="store_false", help="skip the end-of-run samples")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print the full estimate tables (as `builder describe`) before the first step, instead of one line",
    )


def run(args: argparse.Namespace) -> int:
    # a training run handles its signals from its first line, before torch and Lightning load (seconds):
    # none that comes while it starts kills it by default, and SLURM's warning is kept for its first step
    stop = None if args.dry_run else SignalStop()
    try:
        with stop.installed() if stop is not None else contextlib.nullcontext():
            return _run(args, stop)
    except Stopped as exc:  # a signal: the checkpoint it saved is named; 128 + the signal's number
        # local: what says which rank prints loads the recipe's kinds, for a stopped run only
        from yamlformer.recipes.training.run_folder import owns_run_folder

        if owns_run_folder():
            print(f"builder train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def _run(args: argparse.Namespace, stop: SignalStop | None) -> int:
    try:
        load_plugins_from_args(args)
        overrides = overrides_from_args(args)
        recipe = recipe_path(args.recipe)  # a path, else a zoo name
        _check_cooldown_arguments(args)
        if args.dry_run:  # torch and Lightning are not imported
            # local: builder train --help loads no resolution nor estimate (benchmarks/startup.py)
            from yamlformer.recipes.training.dry_run import dry_run

            dry_run(recipe, overrides, resume=args.resume, fresh=args.fresh)
            return 0
    except (SpecError, PluginError) as exc:
        print(exc, file=sys.stderr)
        return 1
    except RecipeError as exc:
        print(f"builder train: {exc}", file=sys.stderr)
        return 1
    return _train(args, recipe, overrides, stop)


def _check_cooldown_arguments(args: argparse.Namespace) -> None:
    if (args.cooldown_from is None) != (args.steps is None):
        raise RecipeError("--cooldown-from CKPT and --steps N go together: a cooldown of N steps from CKPT")
    if args.cooldown_from is not None and (args.resume is not None or args.dry_run):
        raise RecipeError("--cooldown-from branches from its checkpoint (and resumes itself): no --resume or --dry-run")


def _train(args: argparse.Namespace, recipe, overrides, stop: SignalStop) -> int:
    # local: training imports torch and Lightning (seconds), which the dry run and the refusals before it never load
    from yamlformer.recipes.learning.module import NonFiniteLossError
    from yamlformer.recipes.training.run_folder import os_problem

    try:
        if args.cooldown_from is not None:
            # local: as above (torch and Lightning)
            from yamlformer.recipes.training.cooldown import cooldown

            cooldown(recipe, overrides, args.cooldown_from, args.steps, args.fresh, args.samples, args.verbose, stop)
        else:
            # local: as above (torch and Lightning)
            from yamlformer.recipes.training.run import run as train

            train(
                recipe,
                overrides,
                resume=args.resume,
                fresh=args.fresh,
                samples=args.samples,
                verbose=args.verbose,
                stop=stop,
            )
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 1
    except (RecipeError, NonFiniteLossError) as exc:
        print(f"builder train: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a log, plot or cache file that could not be written or read
        print(f"builder train: {os_problem(exc)}", file=sys.stderr)
        return 1
    return 0
