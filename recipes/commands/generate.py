"""`builder generate CKPT --prompt TEXT`: decode from a checkpoint, streaming text to stdout."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint written by `builder train`, or a decoder-only model folder with its "
                        "tokenizer (a `builder import-hf` output or a Hugging Face folder)")
    parser.add_argument("--prompt", "--text", dest="prompt", required=True,
                        help="the text to continue (a translation checkpoint: to translate; classification: to label)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--num-beams", type=int, default=1, help=">1: beam search (greedy, printed at the end)")
    parser.add_argument("--seed", type=int, default=None, help="seed the sampler for a repeatable sample")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")


def run(args: argparse.Namespace) -> int:
    import torch

    from recipes.checkpoint import load_trained
    from recipes.config import RecipeError
    from recipes.generation import stream

    try:
        model, tokenizer, meta = load_trained(args.checkpoint, args.device, folders=True)
        if meta.get("task", "lm") != "lm":
            from recipes.tasks import generate

            print(generate(model, tokenizer, meta, args))
            return 0
        generator = None
        if args.seed is not None:
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
        temperature = 0.0 if args.num_beams > 1 else args.temperature
        sys.stdout.write(args.prompt)
        stream(model, tokenizer, args.prompt, sys.stdout, args.max_new_tokens, temperature=temperature,
               top_k=args.top_k, top_p=args.top_p, num_beams=args.num_beams, generator=generator)
        sys.stdout.write("\n")
    except (RecipeError, ValueError) as exc:
        print(f"\nbuilder generate: {exc}", file=sys.stderr)
        return 1
    return 0
