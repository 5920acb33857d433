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

from yamlformer.blocks.limits import MAX_SEQ_LEN
from yamlformer.builder.cli.arguments import (
    MAX_BATCH,
    MAX_BEAMS,
    ArgumentError,
    at_most,
    count,
    device,
    input_file,
    input_path,
    number,
    output_file,
)
from yamlformer.builder.cli.common import add_plugin_option, load_plugins_from_args
from yamlformer.builder.spec.plugins import PluginError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.tasks import NAMES, task_named, task_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    harness = parser.add_argument_group("downstream tasks (LM checkpoints; EleutherAI's lm-evaluation-harness)")
    harness.add_argument(
        "--tasks",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        metavar="NAME,...",
        help="score lm-eval tasks instead of the loss: lm-eval's own, or defined in --task-path (default: none)",
    )
    harness.add_argument(
        "--task-path",
        metavar="DIR",
        type=input_path,
        help="a folder of lm-eval task YAML files, which may name local data files (default: lm-eval's tasks only)",
    )
    harness.add_argument(
        "--limit", type=count(), metavar="N", help="score the first N examples of each task (default: all)"
    )
    harness.add_argument(
        "--num-fewshot", type=count(minimum=0), metavar="K", help="few-shot examples per prompt (default: the task's)"
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


def refuse_options(args: argparse.Namespace, meta: dict, options: str) -> None:
    """An option given that the checkpoint's task does not read is an error, not ignored
    (``options``: ``"eval_options"`` or ``"generate_options"``, the tasks' own lists)."""
    task = task_of(meta)
    read = {name: getattr(task_named(name), options) for name in NAMES}
    for name in sorted({n for names in read.values() for n in names} - set(getattr(task, options))):
        if getattr(args, name, None) not in (None, False):
            takers = [t for t, names in read.items() if name in names]
            raise ArgumentError(
                f"--{name.replace('_', '-')} applies to {' and '.join(takers)} checkpoints; "
                f"{args.checkpoint} is a checkpoint of task {task.name}"
            )


def run(args: argparse.Namespace) -> int:
    # local: the commands load torch-free (tests/test_layering.py TORCH_FREE); a checkpoint's reader imports torch
    from yamlformer.recipes.trained import load_trained

    try:
        load_plugins_from_args(args)
        model, tokenizer, meta = load_trained(args.checkpoint, args.device)
        refuse_options(args, meta, "eval_options")
        task = task_of(meta)
        task.check_eval_arguments(args)
        at_most("--seq-len", args.seq_len, meta["spec"]["max_seq_len"], "the model's max_seq_len")
        metrics = task.evaluate(model, tokenizer, meta, args)
    except (RecipeError, ArgumentError, PluginError) as exc:
        print(f"builder eval: {exc}", file=sys.stderr)
        return 1
    result = {"checkpoint": args.checkpoint, "step": meta["global_step"], "task": task.name, **metrics}
    if args.json:
        print(json.dumps(result))
    else:
        task.print_evaluation(result, args)
    return 0
