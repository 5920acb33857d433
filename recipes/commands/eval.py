"""`builder eval CKPT`: validation loss and perplexity of a checkpoint written by `builder train`."""

from __future__ import annotations

import argparse
import json
import sys

from blocks.limits import MAX_SEQ_LEN
from builder.commands.common import add_plugin_option, load_plugins_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from builder.commands.arguments import MAX_BATCH, MAX_BEAMS, count, device, input_file, input_path, number, output_file

    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by `builder train`")
    parser.add_argument("--data", nargs="+", metavar="PATH", type=input_path,
                        help="text files or folders to evaluate on (default: the recipe's validation split)")
    parser.add_argument("--seq-len", type=count(maximum=MAX_SEQ_LEN),
                        help="tokens per window, at most the model's max_seq_len (default: the recipe's)")
    parser.add_argument("--batch-size", type=count(maximum=MAX_BATCH), help="windows per batch (default: the recipe's)")
    parser.add_argument("--max-batches", type=count(), help="stop after this many batches (default: all the data)")
    parser.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    add_plugin_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    task = parser.add_argument_group("translation checkpoints (default: the recipe's validation pair and beam)")
    task.add_argument("--src", metavar="FILE", type=input_file, help="source sentences, one a line")
    task.add_argument("--ref", metavar="FILE", type=input_file, help="their reference translations, line for line")
    task.add_argument("--split", metavar="NAME",
                      help="a split of the recipe's dataset instead of its validation split (multi30k: test2016)")
    task.add_argument("--num-beams", type=count(maximum=MAX_BEAMS), help="beam size (1: greedy)")
    task.add_argument("--length-penalty", type=number(minimum=-100, maximum=100),
                      help="beam score = sum log p / length ** this")
    task.add_argument("--max-sentences", type=count(), help="score only the first N pairs")
    task.add_argument("--output", metavar="FILE", type=output_file, help="write the translations here")


#: the options each task's evaluation reads (the others are refused, not ignored)
OPTIONS = {
    "lm": ("data", "seq_len", "batch_size", "max_batches"),
    "translation": ("src", "ref", "split", "num_beams", "length_penalty", "max_sentences", "output"),
    "mlm": ("max_batches",),
    "classification": ("data", "max_batches"),
}


def refuse_options(args: argparse.Namespace, meta: dict, options: dict[str, tuple[str, ...]]) -> None:
    """An option given that the checkpoint's task does not read is an error, not ignored."""
    from builder.commands.arguments import ArgumentError

    task = meta.get("task", "lm")
    used = options.get(task, ())
    for name in sorted({n for names in options.values() for n in names} - set(used)):
        if getattr(args, name, None) not in (None, False):
            takers = [t for t, names in options.items() if name in names]
            raise ArgumentError(f"--{name.replace('_', '-')} applies to {' and '.join(takers)} checkpoints; "
                                f"{args.checkpoint} is a checkpoint of task {task}")
    data = getattr(args, "data", None)
    if task == "classification" and data and len(data) > 1:
        raise ArgumentError(f"--data takes one file of labelled examples for a classification checkpoint, "
                            f"got {len(data)}")


def run(args: argparse.Namespace) -> int:
    from builder.commands.arguments import ArgumentError, at_most
    from builder.plugins import PluginError
    from recipes.checkpoint import evaluate, file_tokens, load_trained, recipe_tokens
    from recipes.config import RecipeError

    try:
        load_plugins_from_args(args)
        model, tokenizer, meta = load_trained(args.checkpoint, args.device)
        refuse_options(args, meta, OPTIONS)
        at_most("--seq-len", args.seq_len, meta["spec"]["max_seq_len"], "the model's max_seq_len")
        if meta.get("task", "lm") != "lm":
            return _print_task(args, meta, model, tokenizer)
        data = meta["recipe"]["data"]
        if args.data:
            tokens = file_tokens(args.data, tokenizer, data["cache_dir"])
        else:
            tokens = recipe_tokens(meta, tokenizer)
        result = evaluate(model, tokens, args.seq_len or data["seq_len"], args.batch_size or data["batch_size"],
                          args.max_batches)
    except (RecipeError, ArgumentError, PluginError) as exc:
        print(f"builder eval: {exc}", file=sys.stderr)
        return 1
    result = {"checkpoint": args.checkpoint, "step": meta["global_step"],
              "data": args.data or "validation split", **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.checkpoint} (step {result['step']}) on {result['data']}: {result['tokens']:,} tokens, "
              f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}")
    return 0


def _print_task(args: argparse.Namespace, meta: dict, model, tokenizer) -> int:
    """Translation: sacreBLEU and chrF; classification: accuracy and macro F1; mlm: masked loss."""
    from recipes.tasks import evaluate

    result = {"checkpoint": args.checkpoint, "step": meta["global_step"], "task": meta["task"],
              **evaluate(model, tokenizer, meta, args)}
    if args.json:
        print(json.dumps(result))
        return 0
    for key, value in result.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return 0
