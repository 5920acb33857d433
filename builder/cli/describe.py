"""``builder describe SPEC``: analytic parameters, FLOPs and memory, as tables or JSON.

Torch-free: the estimate is summed from the block configs, so describing GPT-3 takes well under
a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from yamlformer.blocks.limits import MAX_HEADS, MAX_SEQ_LEN
from yamlformer.builder.analysis.estimates import Step, estimate
from yamlformer.builder.analysis.layout import Layout, LayoutError, check_layout
from yamlformer.builder.analysis.layout_memory import layout_memory as rank_memory
from yamlformer.builder.analysis.report import human_bytes, plot, print_describe
from yamlformer.builder.cli.arguments import MAX_BATCH, MAX_DEVICES, at_most, count
from yamlformer.builder.cli.common import add_spec_options, spec_from_args
from yamlformer.builder.hf import export_line
from yamlformer.builder.parametrization import summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="a spec file (YAML) or a zoo name (`builder list`)")
    add_estimate_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw where parameters and FLOPs go (needs matplotlib; default: no plot)",
    )
    add_spec_options(parser)


def add_estimate_options(parser: argparse.ArgumentParser) -> None:
    """The sizing options ``describe`` and ``diff`` share."""
    parser.add_argument(
        "--seq-len",
        type=count(maximum=MAX_SEQ_LEN),
        help="tokens per sequence, at most the spec's max_seq_len (default max_seq_len)",
    )
    parser.add_argument(
        "--src-len", type=count(maximum=MAX_SEQ_LEN), help="encoder-decoder: source tokens (default --seq-len)"
    )
    parser.add_argument("--batch", type=count(maximum=MAX_BATCH), default=1, help="sequences per device (default 1)")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="compute dtype (default bf16; bf16/fp16 train with fp32 master weights)",
    )
    parser.add_argument(
        "--devices", type=count(maximum=MAX_DEVICES), default=1, help="devices in all, over every node (default 1)"
    )
    parser.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp replicates everything; fsdp (FSDP2) shards weights, gradients and "
        "optimizer state and counts what each rank holds, exactly",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=count(maximum=MAX_HEADS),
        default=1,
        metavar="T",
        help="fsdp: ranks inside a node that split each layer (heads, FFN width, vocabulary); default 1",
    )
    parser.add_argument(
        "--data-parallel",
        choices=("shard", "hybrid", "replicate"),
        default=None,
        help="fsdp: shard over every data-parallel rank (default), hybrid (HSDP: shard "
        "inside a node, replicate across nodes) or replicate",
    )
    for option, what in (
        ("--pipeline-parallel", "pipeline stages, each holding consecutive layers"),
        ("--context-parallel", "ranks splitting each sequence (ring attention)"),
        ("--expert-parallel", "ranks splitting a mixture of experts' experts"),
    ):
        parser.add_argument(
            option,
            type=count(maximum=MAX_DEVICES),
            default=1,
            metavar="N",
            help=f"fsdp: {what}; sized per stage by the performance model "
            "(yamlformer.builder.analysis.perf); default 1",
        )
    parser.add_argument(
        "--schedule",
        choices=("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble"),
        default="1f1b",
        help="--pipeline-parallel: the schedule, which sets the micro-batches in flight (default 1f1b)",
    )
    parser.add_argument(
        "--pipeline-microbatches",
        type=count(maximum=MAX_DEVICES),
        metavar="M",
        help="--pipeline-parallel: micro-batches per step (default one per stage, as torchtitan)",
    )
    parser.add_argument(
        "--nodes", type=count(maximum=MAX_DEVICES), default=1, help="machines the devices are spread over (default 1)"
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing on every layer (train FLOPs 4x forward)"
    )
    parser.add_argument(
        "--attention",
        choices=("fused", "eager"),
        default="fused",
        help="activation accounting: a fused kernel saves no (seq, seq) tensor",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        metavar="TYPE",
        help="the optimizer whose state is counted, as it declares it: adamw (default; two fp32 states) | "
        "muon (one on hidden matrices) | sgd (its momentum) | a plugin's",
    )


def estimate_from_args(spec, args: argparse.Namespace):
    """The estimate the sizing options ask for; a bad combination raises ``ValueError`` whose
    message names the option (``--tensor-parallel 3: decoder.attention.n_heads: ...``)."""
    limit = f"{spec.name}'s max_seq_len"
    at_most("--seq-len", args.seq_len, spec.max_seq_len, limit)
    at_most("--src-len", args.src_len, spec.max_seq_len, limit)
    if args.strategy != "fsdp":
        for option, value, default in (
            ("--tensor-parallel", args.tensor_parallel, 1),
            ("--data-parallel", args.data_parallel, None),
            *((f"--{n}-parallel", getattr(args, f"{n}_parallel", 1), 1) for n in ("pipeline", "context", "expert")),
        ):
            if value != default:
                raise ValueError(f"{option} needs --strategy fsdp (ddp replicates the whole model)")
    staged = max(getattr(args, "pipeline_parallel", 1), getattr(args, "context_parallel", 1)) > 1
    try:
        layout = Layout(  # expert parallelism alone: counted exactly per rank (yamlformer.builder.analysis.layout)
            devices=args.devices,
            nodes=args.nodes,
            tensor_parallel=args.tensor_parallel,
            data_parallel=args.data_parallel or "shard",
            strategy=args.strategy,
            expert_parallel=1 if staged else getattr(args, "expert_parallel", 1),
        )
        step = Step(
            seq_len=args.seq_len,
            src_len=args.src_len,
            batch=args.batch,
            dtype=args.dtype,
            activation_checkpointing=args.checkpointing,
            fused_attention=args.attention == "fused",
            optimizer=args.optimizer,
        )
        full = _five_d(layout, args)
        if full is not None:
            check_layout(spec, full, args.seq_len or spec.max_seq_len)
        return estimate(spec, step, layout)
    except LayoutError as exc:
        raise ValueError(option_error(exc)) from None


def _five_d(layout, args):
    """The layout with the pipeline, context and expert degrees the options give, or None when all are 1."""
    degrees = {f"{n}_parallel": getattr(args, f"{n}_parallel", 1) for n in ("pipeline", "context", "expert")}
    if all(value == 1 for value in degrees.values()):
        return None
    return dataclasses.replace(layout, **degrees)


def layout_memory(spec, args) -> dict | None:
    """Per-GPU memory of the options' layout with pipeline, context or expert parallelism
    (:func:`yamlformer.builder.analysis.layout_memory.layout_memory`); None for other layouts."""
    layout = _five_d(
        Layout(
            devices=args.devices,
            nodes=args.nodes,
            tensor_parallel=args.tensor_parallel,
            data_parallel=args.data_parallel or "shard",
            strategy=args.strategy,
        ),
        args,
    )
    if layout is None:
        return None
    return rank_memory(
        spec,
        layout,
        seq_len=Step(seq_len=args.seq_len).seq_len or spec.max_seq_len,
        micro_batch=args.batch,
        dtype=args.dtype,
        checkpointing=args.checkpointing,
        schedule=getattr(args, "schedule", "1f1b"),
        microbatches=getattr(args, "pipeline_microbatches", None),
        optimizer=args.optimizer,
    )


def option_error(exc) -> str:
    """A :class:`yamlformer.builder.analysis.layout.LayoutError` as the option at fault:
    ``--tensor-parallel 3: ...``."""
    if exc.argument == "spec":
        return f"{exc.value}: {exc.reason}"
    return f"--{exc.argument.replace('_', '-')} {exc.value}: {exc.reason}"


def _layout_text(data: dict) -> str:
    return Layout.from_dict(data).describe()


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    try:
        est = estimate_from_args(spec, args)
    except ValueError as exc:  # ArgumentError too
        print(f"error: {exc}", file=sys.stderr)
        return 1
    five_d = layout_memory(spec, args)
    if args.json:
        shown = {"parametrization": summary(spec), **({"layout_memory": five_d} if five_d else {})}
        print(json.dumps({**est.to_dict(), **shown}, indent=2))
    else:
        print_describe(spec, est)
        if five_d:
            parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in five_d["parts"].items())
            print(
                f"per GPU on {_layout_text(five_d['layout'])} (the stage holding the most, micro-batches of "
                f"{args.batch} as the {args.schedule} schedule keeps them; yamlformer.builder.analysis.perf): "
                f"{human_bytes(five_d['per_gpu_bytes'])} "
                f"({parts}); the tables above are the layout without pipeline or context parallelism"
            )
        print(f"export: {export_line(spec)}")
    if args.plot:
        plot(spec, est, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
