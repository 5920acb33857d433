"""``builder describe SPEC``: analytic parameters, FLOPs and memory, as tables or JSON.

Torch-free: the estimate is summed from the block configs, so describing GPT-3 takes well under
a second.
"""

from __future__ import annotations

import argparse
import json

from builder.commands.common import add_spec_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file (YAML)")
    add_estimate_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw where parameters and FLOPs go (needs matplotlib)")
    add_spec_options(parser)


def add_estimate_options(parser: argparse.ArgumentParser) -> None:
    """The sizing options ``describe`` and ``diff`` share."""
    parser.add_argument("--seq-len", type=_positive, help="tokens per sequence (default max_seq_len)")
    parser.add_argument("--src-len", type=_positive,
                        help="encoder-decoder: source tokens (default --seq-len)")
    parser.add_argument("--batch", type=_positive, default=1, help="sequences per device (default 1)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="compute dtype (default bf16; bf16/fp16 train with fp32 master weights)")
    parser.add_argument("--devices", type=_positive, default=1, help="data-parallel devices (default 1)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="ddp replicates everything; fsdp shards weights, gradients, optimizer")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing on every layer (train FLOPs 4x forward)")
    parser.add_argument("--attention", choices=("fused", "eager"), default="fused",
                        help="activation accounting: a fused kernel saves no (seq, seq) tensor")


def estimate_from_args(spec, args: argparse.Namespace):
    from builder.estimates import estimate

    return estimate(
        spec, seq_len=args.seq_len, src_len=args.src_len, batch=args.batch, dtype=args.dtype,
        devices=args.devices, strategy=args.strategy,
        activation_checkpointing=args.checkpointing, fused_attention=args.attention == "fused",
    )


def run(args: argparse.Namespace) -> int:
    from builder.commands.common import spec_from_args

    spec = spec_from_args(args)
    try:
        est = estimate_from_args(spec, args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        from builder.report import print_describe

        print_describe(spec, est)
    if args.plot:
        from builder.report import plot

        plot(spec, est, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
