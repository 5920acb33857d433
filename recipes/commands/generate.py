"""`builder generate CKPT --prompt TEXT`: decode from a checkpoint, streaming text to stdout."""

from __future__ import annotations

import argparse
import contextlib
import sys

from yamlformer.blocks.limits import MAX_VOCAB
from yamlformer.builder.cli.arguments import (
    MAX_BEAMS,
    MAX_NEW_TOKENS,
    MAX_SEED,
    ArgumentError,
    count,
    device,
    number,
    text,
)
from yamlformer.builder.cli.common import add_plugin_option, load_plugins_from_args
from yamlformer.builder.spec.plugins import PluginError
from yamlformer.recipes.commands.eval import refuse_options
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.tasks import task_of

#: language-model decoding defaults (an option left out)
DEFAULTS = {"max_new_tokens": 200, "temperature": 0.8, "num_beams": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a checkpoint written by `builder train`, or a decoder-only model folder with its "
        "tokenizer (a `builder import-hf` output or a Hugging Face folder)",
    )
    parser.add_argument(
        "--prompt",
        "--text",
        dest="prompt",
        required=True,
        type=text(),
        help="the text to continue (a translation checkpoint: to translate; classification: to label)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=count(maximum=MAX_NEW_TOKENS),
        help=f"tokens to generate (default {DEFAULTS['max_new_tokens']})",
    )
    parser.add_argument(
        "--temperature", type=number(minimum=0, maximum=1e6), help=f"0 is greedy (default {DEFAULTS['temperature']})"
    )
    parser.add_argument(
        "--top-k",
        type=count(maximum=MAX_VOCAB),
        default=None,
        help="sample from the k most likely tokens only (default: every token)",
    )
    parser.add_argument(
        "--top-p",
        type=number(above=0, maximum=1),
        default=None,
        help="sample from the smallest set of tokens whose probability reaches p, in (0, 1] (default: 1, every token)",
    )
    parser.add_argument(
        "--num-beams",
        type=count(maximum=MAX_BEAMS),
        help=">1: beam search (greedy, printed at the end; default 1, or a translation checkpoint's eval.num_beams)",
    )
    parser.add_argument(
        "--seed",
        type=count(minimum=0, maximum=MAX_SEED),
        default=None,
        help="seed the sampler for a repeatable sample (default: a new sample each run)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="decode with a torch.compile'd one-token step over a static KV cache: faster per "
        "token for small models and long outputs, after a compile of several seconds",
    )
    parser.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    add_plugin_option(parser)


def run(args: argparse.Namespace) -> int:
    # local: the commands load torch-free (tests/test_layering.py TORCH_FREE); a checkpoint's reader imports torch
    from yamlformer.recipes.trained import load_trained

    out = _LineTracking(sys.stdout)
    try:
        load_plugins_from_args(args)
        model, tokenizer, meta = load_trained(args.checkpoint, args.device, folders=True)
        refuse_options(args, meta, "generate_options")
        _check_decoding(args)
        for name, value in DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        with contextlib.redirect_stdout(out):
            task_of(meta).generate(model, tokenizer, meta, args)
    except (RecipeError, PluginError, ValueError) as exc:
        if out.mid_line:  # the text streamed so far ends its line first, on its own stream
            out.write("\n")
            out.flush()
        print(f"builder generate: {exc}", file=sys.stderr)
        return 1
    return 0


class _LineTracking:
    """stdout as the decoded text streams to it, knowing whether its last line is unfinished (an
    error then ends that line, and only then)."""

    def __init__(self, stream):
        self.stream, self.mid_line = stream, False

    def write(self, text: str) -> int:
        if text:
            self.mid_line = not text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _check_decoding(args: argparse.Namespace) -> None:
    """Options of one decoding mode given with another are refused, not ignored."""
    sampling = [f"--{n.replace('_', '-')}" for n in ("top_k", "top_p", "seed") if getattr(args, n) is not None]
    if args.num_beams is not None and args.num_beams > 1:
        given = sampling + (["--temperature"] if args.temperature is not None else [])
        if given:
            raise ArgumentError(
                f"{given[0]} applies to sampling; beam search (--num-beams {args.num_beams}) "
                "is deterministic: drop one of them"
            )
    elif args.temperature == 0 and sampling:
        raise ArgumentError(f"{sampling[0]} applies to sampling; --temperature 0 is greedy: drop one of them")
