"""``builder plan SPEC --gpus N --gpu-memory 80GiB --global-batch B``: the cheapest layout that fits.

Prints the layout (tensor-parallel degree, FSDP, HSDP or replication, micro-batch and
accumulation, activation checkpointing), its per-GPU memory as ``builder describe`` counts it,
the step's FLOPs and time at a stated MFU, and the ``torchrun`` and SLURM lines that launch a
recipe with it — or why nothing fits and what would. Torch-free (see ``builder.analysis.plan``). Exit
status 0 when a layout fits, 1 when none does or an argument is bad.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from blocks.limits import MAX_HEADS, MAX_SEQ_LEN
from builder.cli.arguments import MAX_DEVICES, at_most, count, number
from builder.cli.common import add_spec_options

UNITS = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
GPUS = ("a100", "h100", "h100-pcie", "h100-nvl", "h200", "h200-nvl")
DEFAULT_RECIPE = "lm-stdlib.yaml"  # of the recipes package
#: GPUs in one machine (an NVL72 rack counts as one: 72)
MAX_PER_NODE = 4096
#: sequences in one optimizer step
MAX_GLOBAL_BATCH = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="a spec file (YAML) or a zoo name (`builder list`)")
    parser.add_argument("--gpus", type=count(maximum=MAX_DEVICES), required=True, help="GPUs in all")
    parser.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory of one GPU, e.g. 80GiB, 141GB")
    parser.add_argument(
        "--global-batch",
        type=count(maximum=MAX_GLOBAL_BATCH),
        required=True,
        metavar="B",
        help="sequences per optimizer step, over every GPU and accumulation step",
    )
    parser.add_argument("--seq-len", type=count(maximum=MAX_SEQ_LEN), help="tokens per sequence (default max_seq_len)")
    parser.add_argument(
        "--src-len", type=count(maximum=MAX_SEQ_LEN), help="encoder-decoder: source tokens (default --seq-len)"
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        metavar="NAME",
        help=f"the GPU, for its peak FLOP/s: {', '.join(GPUS)} (default h100, the SXM part)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=number(above=0, maximum=1e9),
        metavar="TF",
        help="dense peak TFLOP/s of one GPU in the compute dtype (default: --gpu's)",
    )
    parser.add_argument(
        "--mfu",
        type=number(above=0, maximum=1),
        default=0.4,
        help="model FLOPs utilisation the step time assumes, in (0, 1] (default 0.4)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=count(maximum=MAX_PER_NODE),
        metavar="N",
        help="GPUs in one machine (default 8, or --gpus when fewer)",
    )
    parser.add_argument("--nodes", type=count(maximum=MAX_DEVICES), help="machines (default --gpus / --gpus-per-node)")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="compute dtype (default bf16: bf16-mixed, fp32 master weights)",
    )
    parser.add_argument(
        "--headroom",
        type=number(minimum=0, below=100),
        default=10.0,
        metavar="PERCENT",
        help="memory kept free for the CUDA context, NCCL and fragmentation (default 10)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=count(maximum=MAX_HEADS),
        metavar="T",
        help="consider only this degree (default: every degree that divides the spec)",
    )
    parser.add_argument(
        "--data-parallel",
        choices=("shard", "hybrid", "replicate"),
        help="consider only this data-parallel mode (default: every mode)",
    )
    parser.add_argument(
        "--recipe",
        help="the recipe the launch lines train: a file or a zoo name (default "
        f"{DEFAULT_RECIPE.removesuffix('.yaml')})",
    )
    parser.add_argument(
        "--tokens",
        metavar="N",
        help="tokens to train on, e.g. 300B or 2T: the launch lines' "
        "trainer.max_steps (default: 20 per parameter, Chinchilla's compute-optimal budget)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    from builder.analysis.layout import LayoutError
    from builder.cli.common import spec_from_args
    from builder.cli.describe import option_error

    try:
        cluster = cluster_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    spec = spec_from_args(args)
    from builder.analysis.plan import plan

    try:
        settings = _settings(spec, args)
        recipe_document(args.recipe)  # a recipe that is not there is refused before planning
        tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
        result = plan(spec, cluster, **settings)
    except LayoutError as exc:
        print(f"error: {option_error(exc)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    launch = _launch(result, args, tokens) if result.fits else None
    if args.json:
        print(json.dumps(to_json(result, launch), indent=2))
    else:
        _print(result, launch, args)
    return 0 if result.fits else 1


def cluster_from_args(args: argparse.Namespace):
    """The :class:`builder.analysis.plan.Cluster` the options describe; ``ValueError`` names a bad option."""
    from builder.analysis import mfu
    from builder.analysis.plan import Cluster

    memory = parse_size(args.gpu_memory, "--gpu-memory")
    gpus, per_node, nodes = args.gpus, args.gpus_per_node, args.nodes
    if per_node is None and nodes is not None:
        if gpus % nodes:
            raise ValueError(f"--nodes {nodes}: --gpus {gpus} is not a multiple of it")
        per_node = gpus // nodes
    per_node = per_node or min(8, gpus)
    if per_node > MAX_PER_NODE:
        raise ValueError(
            f"--gpus {gpus} on {nodes} node{'s' * (nodes != 1)} is {per_node:,} GPUs per node, "
            f"more than {MAX_PER_NODE:,}; give more --nodes or --gpus-per-node"
        )
    if gpus % per_node:
        raise ValueError(f"--gpus {gpus} is not a multiple of --gpus-per-node {per_node}")
    if nodes is not None and nodes * per_node != gpus:
        raise ValueError(f"--nodes {nodes}: {nodes} nodes x {per_node} GPUs per node is not --gpus {gpus}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu {args.mfu}: must be in (0, 1], e.g. 0.4 for 40%")
    if not 0 <= args.headroom < 100:
        raise ValueError(f"--headroom {args.headroom}: must be a percentage in [0, 100)")
    device = mfu.match_device(args.gpu.replace("-", " ").replace("_", " "))
    if device is None:
        raise ValueError(f"--gpu {args.gpu!r}: unknown; one of {', '.join(GPUS)} (or give --peak-tflops)")
    override = args.peak_tflops * 1e12 if args.peak_tflops is not None else None
    if override is not None and not override > 0:
        raise ValueError(f"--peak-tflops {args.peak_tflops}: must be positive")
    peak = mfu.peak_flops(device, args.dtype, override)
    return Cluster(gpus=gpus, per_node=per_node, memory=memory, peak=peak, gpu=device, headroom=args.headroom / 100)


def parse_size(text: str, option: str) -> int:
    """``"80GiB"`` -> 85899345920; ``"141GB"``, ``"80 gib"`` and ``"1.5TiB"`` too."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]+)\s*", text)
    unit = match and UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"{option} {text!r}: not a size such as 80GiB or 141GB")
    value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise ValueError(f"{option} {text!r}: must be more than 0")
    return value


def _settings(spec, args) -> dict:
    seq = args.seq_len or spec.max_seq_len
    at_most("--seq-len", seq, spec.max_seq_len, f"{spec.name}'s max_seq_len")
    at_most("--src-len", args.src_len, spec.max_seq_len, f"{spec.name}'s max_seq_len")
    if args.src_len is not None and spec.architecture != "encoder-decoder":
        raise ValueError(f"--src-len applies to encoder-decoder models; {spec.name} is {spec.architecture}")
    return {
        "seq_len": seq,
        "src_len": args.src_len,
        "global_batch": args.global_batch,
        "dtype": args.dtype,
        "mfu": args.mfu,
        "tensor_parallel": args.tensor_parallel,
        "data_parallel": args.data_parallel,
    }


def recipe_document(recipe: str | None):
    """How the launch lines name the recipe — a zoo name as given (``lm-stdlib``, the default),
    a file as an absolute path, so a line runs from any folder — its document kind, which turns
    a plan into the recipe's settings (``builder.spec.kinds``), and the merged file (not validated:
    ``builder train`` does that)."""
    from builder.spec.kinds import kind_of
    from builder.spec.loader import SpecError, read_merged
    from builder.zoo import ZooError, locate

    shown = recipe if recipe is not None else DEFAULT_RECIPE.removesuffix(".yaml")
    try:
        path = locate(shown)
    except ZooError as exc:
        raise ValueError(f"--recipe {shown}: {exc}") from None
    if not path.is_file():
        raise ValueError(f"--recipe {shown}: not a file")
    try:
        data = read_merged(path).data
    except SpecError as exc:
        raise ValueError(f"--recipe {shown}: {str(exc).splitlines()[0]}") from None
    kind = kind_of(data)
    if kind is None or kind.launch is None:
        what = f"this is {kind.title}" if kind is not None else "its keys say no kind of file"
        raise ValueError(f"--recipe {shown}: {what}, not a file `builder train` runs")
    named = shown if not os.path.exists(shown) else os.path.abspath(shown)
    return named, kind, data


#: tokens per parameter of the default budget: compute-optimal training (Hoffmann et al. 2022)
CHINCHILLA_TOKENS_PER_PARAMETER = 20


def parse_count(text: str, option: str) -> int:
    """``"300B"`` -> 300_000_000_000; ``2T``, ``1.5e9``, ``500M``, ``4096`` too."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kKmMbBtT]?)\s*", text)
    if not match:
        raise ValueError(f"{option} {text!r}: not a count such as 300B, 2T or 1e9")
    value = int(float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()])
    if not 0 < value <= 10**16:
        raise ValueError(f"{option} {text!r}: must be from 1 to 10,000T")
    return value


def _launch(result, args, tokens: int | None) -> dict:
    from builder.analysis.plan import Launch, launch_lines

    recipe, kind, document = recipe_document(args.recipe)
    spec = os.path.abspath(args.spec) if os.path.exists(args.spec) else args.spec  # a zoo name stays one
    budget = tokens if tokens is not None else CHINCHILLA_TOKENS_PER_PARAMETER * result.estimate.params.total
    max_steps = max(1, -(-budget // result.tokens_per_step))
    layout = result.chosen.layout
    launch = Launch(
        result.chosen,
        seq_len=result.seq_len,
        dtype=result.dtype,
        spec=spec,
        spec_overrides=tuple(args.overrides),
        max_steps=max_steps,
        output_dir=os.path.join("runs", f"{result.spec_name}-{layout.devices}gpus"),
    )
    sets = kind.launch(document, launch)
    lines = launch_lines(recipe, sets, layout)
    return {
        **lines,
        "set": sets,
        "describe": _describe_line(result, args),
        "tokens": max_steps * result.tokens_per_step,
        "max_steps": max_steps,
        "output_dir": launch.output_dir,
        "budget": "--tokens" if tokens is not None else f"{CHINCHILLA_TOKENS_PER_PARAMETER} tokens per parameter",
    }


def _describe_line(result, args) -> str:
    import shlex

    c, layout = result.chosen, result.chosen.layout
    parts = [
        "builder",
        "describe",
        args.spec,
        "--seq-len",
        str(result.seq_len),
        "--batch",
        str(c.micro_batch),
        "--dtype",
        result.dtype,
        "--devices",
        str(layout.devices),
        "--nodes",
        str(layout.nodes),
        "--strategy",
        "fsdp",
        "--tensor-parallel",
        str(layout.tensor_parallel),
        "--data-parallel",
        layout.data_parallel,
    ]
    if result.src_len:
        parts += ["--src-len", str(result.src_len)]
    if c.checkpointing:
        parts.append("--checkpointing")
    for item in args.overrides:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


def to_json(result, launch) -> dict:
    from builder.analysis.plan import CHEAPEST

    cluster = result.cluster
    out = {
        "spec": result.spec_name,
        "cluster": {
            "gpus": cluster.gpus,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.per_node,
            "gpu": cluster.gpu,
            "gpu_memory": cluster.memory,
            "usable_memory": cluster.usable,
            "headroom": cluster.headroom,
            "peak_flops": cluster.peak,
        },
        "settings": {
            "seq_len": result.seq_len,
            "src_len": result.src_len,
            "global_batch": result.global_batch,
            "tokens_per_step": result.tokens_per_step,
            "dtype": result.dtype,
            "mfu": result.mfu,
        },
        "cheapest": CHEAPEST,
        "fits": result.fits,
        "considered": result.considered,
        "reasons": result.reasons,
    }
    if result.fits:
        c = result.chosen
        out["plan"] = {**c.to_dict(), "tokens_per_s": result.tokens_per_step / c.step_seconds}
        out["memory"] = result.estimate.memory.to_dict()
        out["params"] = result.estimate.params.total
        out["launch"] = launch
        out["alternatives"] = [a.to_dict() for a in result.alternatives]
    else:
        out["would_fit"] = result.would_fit
    return out


def _print(result, launch, args) -> None:
    from rich.console import Console
    from rich.table import Table

    from builder.analysis.plan import CHEAPEST
    from builder.analysis.report import human, human_bytes, memory_table

    console = Console()
    cluster = result.cluster
    console.print(
        f"[bold]{result.spec_name}[/] on {cluster.gpus} x {cluster.gpu} ({cluster.nodes} node"
        f"{'s' if cluster.nodes > 1 else ''} x {cluster.per_node}), {human_bytes(cluster.memory)} each, "
        f"{human_bytes(cluster.usable)} usable ({cluster.headroom:.0%} headroom); seq_len {result.seq_len}, "
        f"global batch {result.global_batch} sequences ({result.tokens_per_step:,} tokens), {result.dtype}",
        highlight=False,
    )
    if not result.fits:
        console.print("[bold red]does not fit[/]:", highlight=False)
        for reason in result.reasons:
            console.print(f"  - {reason}", highlight=False)
        console.print("what would fit:" if result.would_fit else "nothing tried fits.")
        for item in result.would_fit:
            console.print(f"  - {item}", highlight=False)
        return
    c = result.chosen
    console.print(f"[bold green]fits[/]: {c.summary()}", highlight=False)
    est = result.estimate
    console.print(memory_table(est.memory, est.settings, result.seq_len))
    step = Table(
        title=f"one optimizer step at MFU {result.mfu:.0%} of {human(cluster.peak)}FLOP/s per GPU",
        title_justify="left",
        show_header=False,
    )
    step.add_column("what")
    step.add_column("value", justify="right")
    step.add_row("training FLOPs", f"{human(c.step_flops)} ({'4x' if c.checkpointing else '3x'} forward)")
    step.add_row("time", f"{c.step_seconds:.2f} s")
    step.add_row("tokens/s", f"{result.tokens_per_step / c.step_seconds:,.0f}")
    step.add_row("GPU-hours per step", f"{c.gpu_hours:.4f}")
    console.print(step)
    console.print(f"[dim]{CHEAPEST}; {result.considered} layouts fit[/]", highlight=False)
    if result.alternatives:
        console.print("next cheapest:")
        for alt in result.alternatives:
            console.print(
                f"  - {alt.summary()}: {human_bytes(alt.memory)}, {alt.gpu_hours:.4f} GPU-h/step", highlight=False
            )
    console.print(
        f"\n[bold]launch[/] (torchrun on every node; or SLURM): {launch['max_steps']:,} steps of "
        f"{result.tokens_per_step:,} tokens, {human(launch['tokens'])} tokens ({launch['budget']}; "
        f"--tokens sets it), into ./{launch['output_dir']}",
        highlight=False,
    )
    console.print(launch["torchrun"], highlight=False, soft_wrap=True)
    console.print(launch["slurm"], highlight=False, soft_wrap=True)
    console.print("check the memory with:", highlight=False)
    console.print(launch["describe"], highlight=False, soft_wrap=True)
    console.print(
        "[dim]the recipe's tokenizer sets vocab_size; these figures use the spec's "
        f"{result.estimate.params.total:,} parameters[/]",
        highlight=False,
    )
