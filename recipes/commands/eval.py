"""`builder eval CKPT`: validation loss and perplexity of a checkpoint written by `builder train`."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by `builder train`")
    parser.add_argument("--data", nargs="+", metavar="PATH",
                        help="text files or folders to evaluate on (default: the recipe's validation split)")
    parser.add_argument("--seq-len", type=int, help="tokens per window (default: the recipe's)")
    parser.add_argument("--batch-size", type=int, help="windows per batch (default: the recipe's)")
    parser.add_argument("--max-batches", type=int, help="stop after this many batches (default: all the data)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    task = parser.add_argument_group("translation checkpoints (default: the recipe's validation pair and beam)")
    task.add_argument("--src", metavar="FILE", help="source sentences, one a line")
    task.add_argument("--ref", metavar="FILE", help="their reference translations, line for line")
    task.add_argument("--split", metavar="NAME",
                      help="a split of the recipe's dataset instead of its validation split (multi30k: test2016)")
    task.add_argument("--num-beams", type=int, help="beam size (1: greedy)")
    task.add_argument("--length-penalty", type=float, help="beam score = sum log p / length ** this")
    task.add_argument("--max-sentences", type=int, help="score only the first N pairs")
    task.add_argument("--output", metavar="FILE", help="write the translations here")


def run(args: argparse.Namespace) -> int:
    from recipes.checkpoint import evaluate, file_tokens, load_trained, recipe_tokens
    from recipes.config import RecipeError

    try:
        model, tokenizer, meta = load_trained(args.checkpoint, args.device)
        if meta.get("task", "lm") != "lm":
            return _print_task(args, meta, model, tokenizer)
        data = meta["recipe"]["data"]
        if args.data:
            tokens = file_tokens(args.data, tokenizer, data["cache_dir"])
        else:
            tokens = recipe_tokens(meta, tokenizer)
        result = evaluate(model, tokens, args.seq_len or data["seq_len"], args.batch_size or data["batch_size"],
                          args.max_batches)
    except RecipeError as exc:
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
