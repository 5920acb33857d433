"""`builder eval CKPT`: validation loss and perplexity of a checkpoint written by `builder train`.

How much is scored: by default what the run's own validations scored (the recipe's
``trainer.limit_val_batches`` batches; on the recipe's data, the same windows, so the loss is the
run's validation loss); ``--max-batches N`` scores N batches, ``--all`` every batch (of an LM,
consecutive non-overlapping windows). Either way it shows a progress bar and says how many
batches it scored of how many there are.
"""

from __future__ import annotations

import argparse
import json
import sys

from blocks.limits import MAX_SEQ_LEN
from builder.cli.common import add_plugin_option, load_plugins_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from builder.cli.arguments import (
        MAX_BATCH,
        MAX_BEAMS,
        count,
        device,
        input_file,
        input_path,
        number,
        output_file,
    )

    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by `builder train`")
    parser.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        type=input_path,
        help="text files or folders to evaluate on (default: the recipe's validation split)",
    )
    parser.add_argument(
        "--seq-len",
        type=count(maximum=MAX_SEQ_LEN),
        help="tokens per window, at most the model's max_seq_len (default: the recipe's)",
    )
    parser.add_argument("--batch-size", type=count(maximum=MAX_BATCH), help="windows per batch (default: the recipe's)")
    how_many = parser.add_mutually_exclusive_group()
    how_many.add_argument(
        "--max-batches",
        type=count(),
        metavar="N",
        help="score N batches (default: the recipe's trainer.limit_val_batches, as its validations did)",
    )
    how_many.add_argument(
        "--all", action="store_true", help="score every batch (an LM: every consecutive window of the data)"
    )
    parser.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    add_plugin_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    task = parser.add_argument_group("translation checkpoints (default: the recipe's validation pair and beam)")
    task.add_argument(
        "--src",
        metavar="FILE",
        type=input_file,
        help="source sentences, one a line (default: the recipe's validation split)",
    )
    task.add_argument(
        "--ref",
        metavar="FILE",
        type=input_file,
        help="their reference translations, line for line (default: the recipe's)",
    )
    task.add_argument(
        "--split",
        metavar="NAME",
        help="a split of the recipe's dataset instead of its validation split "
        "(multi30k: test2016; default: the validation split)",
    )
    task.add_argument(
        "--num-beams",
        type=count(maximum=MAX_BEAMS),
        help="beam size, 1 is greedy (default: the recipe's eval.num_beams)",
    )
    task.add_argument(
        "--length-penalty",
        type=number(minimum=-100, maximum=100),
        help="beam score = sum log p / length ** this (default: the recipe's eval.length_penalty)",
    )
    task.add_argument("--max-sentences", type=count(), help="score only the first N pairs (default: every pair)")
    task.add_argument(
        "--output", metavar="FILE", type=output_file, help="write the translations here (default: not written)"
    )


#: the options each task's evaluation reads (the others are refused, not ignored)
OPTIONS = {
    "lm": ("data", "seq_len", "batch_size", "max_batches", "all"),
    "translation": ("src", "ref", "split", "num_beams", "length_penalty", "max_sentences", "output"),
    "mlm": ("max_batches", "all"),
    "classification": ("data",),  # every example of the file or the validation split
}


def refuse_options(args: argparse.Namespace, meta: dict, options: dict[str, tuple[str, ...]]) -> None:
    """An option given that the checkpoint's task does not read is an error, not ignored."""
    from builder.cli.arguments import ArgumentError

    task = meta.get("task", "lm")
    used = options.get(task, ())
    for name in sorted({n for names in options.values() for n in names} - set(used)):
        if getattr(args, name, None) not in (None, False):
            takers = [t for t, names in options.items() if name in names]
            raise ArgumentError(
                f"--{name.replace('_', '-')} applies to {' and '.join(takers)} checkpoints; "
                f"{args.checkpoint} is a checkpoint of task {task}"
            )
    data = getattr(args, "data", None)
    if task == "classification" and data and len(data) > 1:
        raise ArgumentError(
            f"--data takes one file of labelled examples for a classification checkpoint, got {len(data)}"
        )


def run(args: argparse.Namespace) -> int:
    from builder.cli.arguments import ArgumentError, at_most
    from builder.spec.plugins import PluginError
    from recipes.checkpoint import load_trained
    from recipes.recipe.sections import RecipeError
    from recipes.tasks.lm import eval_batches, evaluate, file_tokens, recipe_tokens

    try:
        load_plugins_from_args(args)
        model, tokenizer, meta = load_trained(args.checkpoint, args.device)
        refuse_options(args, meta, OPTIONS)
        at_most("--seq-len", args.seq_len, meta["spec"]["max_seq_len"], "the model's max_seq_len")
        if meta.get("task", "lm") != "lm":
            return _print_task(args, meta, model, tokenizer)
        if not isinstance(meta.get("recipe"), dict):
            raise RecipeError(
                f"{args.checkpoint} holds no training recipe (its data, batch size and seq_len) to evaluate with"
            )
        data = meta["recipe"]["data"]
        mixture = None
        if args.data:
            tokens = file_tokens(args.data, tokenizer, data["cache_dir"])
        else:
            try:
                tokens, mixture = recipe_tokens(meta, tokenizer)
            except RecipeError as exc:
                raise RecipeError(f"{args.checkpoint}: {exc}") from None
        # on the recipe's data, the windows its validations drew; on other files, consecutive ones
        seed = None if args.data else meta["recipe"]["trainer"]["seed"]
        result = evaluate(
            model,
            tokens,
            args.seq_len or data["seq_len"],
            args.batch_size or data["batch_size"],
            eval_batches(args, meta),
            seed,
            mixture,
        )
    except (RecipeError, ArgumentError, PluginError) as exc:
        print(f"builder eval: {exc}", file=sys.stderr)
        return 1
    result = {
        "checkpoint": args.checkpoint,
        "step": meta["global_step"],
        "data": args.data or "validation split",
        **result,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.checkpoint} (step {result['step']}) on {result['data']}: {result['tokens']:,} tokens, "
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
        )
        print(scored(result["batches"], result["batches_available"], args))
    return 0


def scored(batches: int, available: int | None, args: argparse.Namespace) -> str:
    """The line that says how much was scored, and how to score all of it."""
    if args.all:
        return f"scored all {batches:,} batches (--all)"
    how = f"--max-batches {args.max_batches}" if args.max_batches else "the recipe's trainer.limit_val_batches"
    drawn = "consecutive windows" if args.data else "the windows the run's validations drew"
    more = ""
    if available is not None and available != batches:  # --all: every consecutive window once
        more = f"; --all scores the whole data once instead ({available:,} consecutive batches)"
    return f"scored {batches:,} batches ({how}: {drawn}){more}"


def _print_task(args: argparse.Namespace, meta: dict, model, tokenizer) -> int:
    """Translation: sacreBLEU and chrF; classification: accuracy and macro F1; mlm: masked loss."""
    from recipes.tasks.base import evaluate

    result = {
        "checkpoint": args.checkpoint,
        "step": meta["global_step"],
        "task": meta["task"],
        **evaluate(model, tokenizer, meta, args),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    available = result.pop("batches_available", None)
    for key, value in result.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    if "batches" in result:
        print(scored(result["batches"], available, args))
    return 0
