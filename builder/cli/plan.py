"""``builder plan SPEC --gpus N --gpu-memory 80GiB --global-batch B``: the cheapest layout that fits.

Prints the layout (tensor-parallel degree, FSDP, HSDP or replication, micro-batch and
accumulation, activation checkpointing), its per-GPU memory as ``builder describe`` counts it,
the step's FLOPs and time at a stated MFU, and the ``torchrun`` and SLURM lines that launch a
recipe with it — or why nothing fits and what would. The plan leads with the best layout the
recipes run; a faster one they do not run is shown beside it, with why. Torch-free (see
``yamlformer.builder.analysis.plan``). Exit status 0 when a layout fits, 1 when none does or an
argument is bad.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from yamlformer.blocks.limits import MAX_SEQ_LEN
from yamlformer.builder.analysis.calibration import lookup
from yamlformer.builder.analysis.hardware import GPUS as _TABLE
from yamlformer.builder.analysis.hardware import gpu
from yamlformer.builder.analysis.layout import LayoutError
from yamlformer.builder.analysis.plan import CHEAPEST, Cluster, plan
from yamlformer.builder.analysis.report import human, human_bytes
from yamlformer.builder.cli.arguments import MAX_DEVICES, at_most, count, number, parse_count, parse_size
from yamlformer.builder.cli.calibrate import add_calibration_arguments, calibrate_first
from yamlformer.builder.cli.common import add_spec_options, spec_from_args
from yamlformer.builder.cli.describe import option_error
from yamlformer.builder.cli.plan_launch import add_launch_arguments, launch_of, print_launch, recipe_document
from yamlformer.builder.spec.loader import SpecError

GPUS = tuple(_TABLE)
#: GPUs in one machine (an NVL72 rack counts as one: 72)
MAX_PER_NODE = 4096
#: sequences in one optimizer step
MAX_GLOBAL_BATCH = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="a spec file (YAML) or a zoo name (`builder list`); optional with --calibrate",
    )
    parser.add_argument(
        "--gpus", type=count(maximum=MAX_DEVICES), help="GPUs in all (required); --calibrate alone takes none"
    )
    parser.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory of one GPU, e.g. 80GiB, 141GB (default: --gpu's HBM)"
    )
    parser.add_argument(
        "--global-batch",
        type=count(maximum=MAX_GLOBAL_BATCH),
        metavar="B",
        help="sequences per optimizer step, over every GPU and accumulation step (default: --global-batch-tokens / "
        "--seq-len; one of the two is required)",
    )
    parser.add_argument(
        "--global-batch-tokens",
        metavar="N",
        help="tokens per optimizer step, e.g. 16Mi (2**24) or 4M (default: --global-batch x --seq-len)",
    )
    parser.add_argument("--seq-len", type=count(maximum=MAX_SEQ_LEN), help="tokens per sequence (default max_seq_len)")
    parser.add_argument(
        "--src-len", type=count(maximum=MAX_SEQ_LEN), help="encoder-decoder: source tokens (default --seq-len)"
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        metavar="NAME",
        help=f"the GPU, its row of the hardware table: {', '.join(GPUS)} (default h100, the SXM part), or a device "
        "`builder plan --calibrate` measured; its kernel rates are its calibration table's (unmeasured: the H200's "
        "fractions of its datasheet on this GPU's, and the plan says so)",
    )
    add_calibration_arguments(parser)
    for option, what in (
        ("--peak-tflops", "dense peak TFLOP/s of one GPU in bf16 (the other dtypes scale with it)"),
        ("--hbm-bandwidth", "HBM bandwidth of one GPU, GB/s"),
        ("--intra-node-bandwidth", "NVLink (or its kin) bandwidth per GPU per direction inside a node, GB/s"),
        ("--inter-node-bandwidth", "network bandwidth per GPU per direction between nodes, GB/s"),
    ):
        parser.add_argument(option, type=number(above=0, maximum=1e9), metavar="X", help=f"{what} (default: --gpu's)")
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
    for option, metavar, what in (
        ("--tensor-parallel", "T", "tensor-parallel degree"),
        ("--pipeline-parallel", "P", "pipeline stages"),
        ("--context-parallel", "C", "context-parallel degree (ring attention)"),
        ("--expert-parallel", "E", "expert-parallel degree"),
        ("--micro-batch", "M", "sequences per micro-batch"),
    ):
        parser.add_argument(
            option, type=count(maximum=MAX_GLOBAL_BATCH), metavar=metavar, help=f"pin the {what} (default: searched)"
        )
    parser.add_argument(
        "--data-parallel",
        choices=("shard", "hybrid", "replicate"),
        help="pin the data-parallel mode: FSDP shard, HSDP hybrid or replicate (default: every mode)",
    )
    parser.add_argument(
        "--checkpointing",
        choices=("none", "selective", "full"),
        help="pin the activation recomputation (default: searched)",
    )
    parser.add_argument(
        "--schedule",
        choices=("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble"),
        help="pin the pipeline schedule (default: searched)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile: fuses memory-bound work")
    parser.add_argument("--async-tp", action="store_true", help="async tensor parallelism: TP collectives overlap")
    parser.add_argument("--float8", action="store_true", help="float8 projections (the GPU's fp8 peak)")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        metavar="TYPE",
        help="the optimizer whose state each GPU holds, as it declares it: adamw (default) | muon | sgd | a plugin's",
    )
    parser.add_argument(
        "--launchable",
        action="store_true",
        help="search only layouts the recipes' runtime runs (its combinations of tensor, context, expert and "
        "pipeline parallel x FSDP/HSDP/replicate, its pipeline schedules, full or no recomputation); without it "
        "the plan leads with the best of those too, with its launch lines, and shows a faster layout the "
        "runtime does not run beside it, with why",
    )
    parser.add_argument(
        "--rank-by", choices=("time", "cost"), default="time", help="rank by step time or GPU-hours (default time)"
    )
    add_launch_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    done = calibrate_first(args)  # --calibrate: measure this GPU (and plan on it when a spec is given)
    if done is not None:
        return done
    try:
        cluster = cluster_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    spec = spec_from_args(args)
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
    result, faster = lead_with_launchable(result, spec, cluster, settings)
    try:
        launch = launch_of(result, args, tokens) if result.fits and not result.chosen.launch_problems() else None
    except ValueError as exc:  # the batch file cannot be written (--sbatch)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(to_json(result, launch, faster), indent=2))
    else:
        _print(result, launch, args, faster)
    return 0 if result.fits else 1


def lead_with_launchable(result, spec, cluster, settings: dict):
    """``(plan, faster)``: when the fastest layout is one the recipes' runtime does not run, the
    plan of the layouts it does run (the same pins; its lines launch it) and the faster plan,
    shown beside it with why it does not launch; else ``(result, None)``. ``--launchable``
    searched only those already; a plan where no runnable layout fits keeps the fastest."""
    if settings["launchable"] or not result.fits or not result.chosen.launch_problems():
        return result, None
    try:
        runnable = plan(spec, cluster, **{**settings, "launchable": True}, suggest=False)
    except LayoutError:  # a pin the runtime cannot run: the plan says why it has no lines
        return result, None
    return (runnable, result) if runnable.fits else (result, None)


def cluster_from_args(args: argparse.Namespace):
    """The :class:`yamlformer.builder.analysis.plan.Cluster` the options describe, with its GPU's
    calibration (``yamlformer.builder.analysis.calibration.lookup``); ``ValueError`` names a bad option."""
    try:
        key, row, calibration = lookup(args.gpu, getattr(args, "calibration_dir", None))
    except SpecError as exc:
        raise ValueError(f"--gpu {args.gpu}: its calibration table is malformed:\n{exc}") from None
    memory = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else row.memory
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
    if not 0 <= args.headroom < 100:
        raise ValueError(f"--headroom {args.headroom}: must be a percentage in [0, 100)")
    giga = 1e9
    row = gpu(
        key,
        row,
        hbm_bandwidth=args.hbm_bandwidth and args.hbm_bandwidth * giga,
        intra_node=args.intra_node_bandwidth and args.intra_node_bandwidth * giga,
        inter_node=args.inter_node_bandwidth and args.inter_node_bandwidth * giga,
    )
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else row.peak["bf16"]
    return Cluster(
        gpus=gpus,
        per_node=per_node,
        memory=memory,
        peak=peak,
        gpu=row.name,
        headroom=args.headroom / 100,
        hardware=row,
        calibration=calibration,
    )


def _settings(spec, args) -> dict:
    seq = args.seq_len or spec.max_seq_len
    at_most("--seq-len", seq, spec.max_seq_len, f"{spec.name}'s max_seq_len")
    at_most("--src-len", args.src_len, spec.max_seq_len, f"{spec.name}'s max_seq_len")
    if args.src_len is not None and spec.architecture != "encoder-decoder":
        raise ValueError(f"--src-len applies to encoder-decoder models; {spec.name} is {spec.architecture}")
    batch = args.global_batch
    if args.global_batch_tokens is not None:
        tokens = parse_count(args.global_batch_tokens, "--global-batch-tokens")
        if batch is not None:
            raise ValueError("--global-batch-tokens: give it or --global-batch, not both")
        if tokens % seq:
            raise ValueError(f"--global-batch-tokens {args.global_batch_tokens}: not a multiple of --seq-len {seq}")
        batch = tokens // seq
    if batch is None:
        raise ValueError("--global-batch (sequences) or --global-batch-tokens is required")
    return {
        "seq_len": seq,
        "src_len": args.src_len,
        "global_batch": batch,
        "dtype": args.dtype,
        "rank_by": args.rank_by,
        "tensor_parallel": args.tensor_parallel,
        "pipeline_parallel": args.pipeline_parallel,
        "context_parallel": args.context_parallel,
        "expert_parallel": args.expert_parallel,
        "data_parallel": args.data_parallel,
        "micro_batch": args.micro_batch,
        "checkpointing": args.checkpointing,
        "schedule": args.schedule,
        "compile": args.compile,
        "async_tp": args.async_tp,
        "float8": args.float8,
        "attention": args.attention,
        "optimizer": args.optimizer,
        "launchable": args.launchable,
    }


def not_launchable(candidate) -> str | None:
    """``not launchable: REASON`` for a layout the recipes' runtime does not run (the first of
    ``yamlformer.builder.analysis.runtime``'s refusals, naming the trainer field), None for one it does."""
    problems = candidate.launch_problems()
    return f"not launchable: trainer.{problems[0][0]}: {problems[0][1]}" if problems else None


def to_json(result, launch, faster=None) -> dict:
    cluster = result.cluster
    hw = cluster.hardware
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
            "hbm_bandwidth": hw.hbm_bandwidth,
            "intra_node_bandwidth": hw.intra_node,
            "inter_node_bandwidth": hw.inter_node,
        },
        "settings": {
            "seq_len": result.seq_len,
            "src_len": result.src_len,
            "global_batch": result.global_batch,
            "tokens_per_step": result.tokens_per_step,
            "dtype": result.dtype,
        },
        "calibration": result.calibration.to_dict(),
        "ranking": CHEAPEST,
        "fits": result.fits,
        "considered": result.considered,
        "fitting": result.fitting,
        "reasons": result.reasons,
        "params": result.params,
        "fsdp_only": result.baseline.to_dict() if result.baseline is not None else None,
        "no_tensor_or_pipeline": result.untiled.to_dict() if result.untiled is not None else None,
    }
    if result.fits:
        c = result.chosen
        out.update(
            {
                "tokens_per_s_per_gpu": c.prediction.tokens_per_s_per_gpu,
                "mfu": c.prediction.mfu,
                "step_s": c.step_seconds,
                "memory_per_gpu_bytes": c.memory,
                "layout": c.layout.to_dict(),
            }
        )
        out["plan"] = {**c.to_dict(), "tokens_per_s": result.tokens_per_step / c.step_seconds}
        out["launch"] = launch
        out["not_launchable"] = not_launchable(c)
        out["alternatives"] = [a.to_dict() for a in result.alternatives]
        out["faster_not_launchable"] = (
            {**faster.chosen.to_dict(), "not_launchable": not_launchable(faster.chosen)} if faster else None
        )
    else:
        out["would_fit"] = result.would_fit
    return out


def _print(result, launch, args, faster=None) -> None:
    console = Console()
    cluster = result.cluster
    console.print(
        f"[bold]{result.spec_name}[/] on {cluster.gpus} x {cluster.gpu} ({cluster.nodes} node"
        f"{'s' if cluster.nodes > 1 else ''} x {cluster.per_node}), {human_bytes(cluster.memory)} each, "
        f"{human_bytes(cluster.usable)} usable ({cluster.headroom:.0%} headroom); seq_len {result.seq_len}, "
        f"global batch {result.global_batch} sequences ({result.tokens_per_step:,} tokens), {result.dtype}",
        highlight=False,
    )
    if not result.calibration.measured:
        console.print(f"[yellow]kernel rates {result.calibration.source}[/]", highlight=False)
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
    if faster is not None:
        quicker = faster.chosen
        gain = c.step_seconds / quicker.step_seconds - 1
        console.print(
            f"faster, not launchable by the recipes: {quicker.summary()}; {quicker.step_seconds:.3g} s per step, "
            f"{gain:.0%} faster; {not_launchable(quicker)}",
            highlight=False,
        )
    table = Table(title="predicted step (the GPU holding the most memory)", title_justify="left")
    for column in ("layout", "step s", "tokens/s/GPU", "MFU", "memory/GPU", "fits"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    rows = [c, *([faster.chosen] if faster is not None else []), *result.alternatives]
    compared = {
        id(cand): label
        for cand, label in ((result.baseline, "FSDP only"), (result.untiled, "no TP or PP"))
        if cand is not None
    }
    if faster is not None:
        compared[id(faster.chosen)] = "faster, not launchable"
    for cand in (result.baseline, result.untiled):
        if cand is not None and all(cand is not r for r in rows):
            rows.append(cand)
    for i, cand in enumerate(rows):
        p = cand.prediction
        table.add_row(
            ("* " if i == 0 else "") + _short(cand) + (f" ({compared[id(cand)]})" if id(cand) in compared else ""),
            f"{p.step_s:.3g}",
            f"{p.tokens_per_s_per_gpu:,.0f}",
            f"{p.mfu:.0%}",
            human_bytes(p.memory_per_gpu_bytes),
            "yes" if p.memory_per_gpu_bytes <= cluster.usable else "no",
        )
    console.print(table)
    parts = Table(title="where the time goes (seconds per step)", title_justify="left")
    parts.add_column("part")
    beside = [faster.chosen] if faster is not None else []
    shown = [c, *beside] + [cand for cand in (result.baseline, result.untiled) if cand is not None and cand is not c]
    for cand in shown:
        parts.add_column(_short(cand), justify="right")
    for part in c.prediction.breakdown:
        parts.add_row(part.replace("_", " "), *(f"{cand.prediction.breakdown[part]:.3g}" for cand in shown))
    console.print(parts)
    if result.baseline is None:
        why = [r for r in result.reasons if r.startswith("tensor 1 x pipeline 1 x context 1:")]
        console.print(
            f"FSDP only (no tensor, pipeline, context or expert parallelism): impossible: "
            f"{why[0].split(': ', 1)[1] if why else 'no such layout was tried'}",
            highlight=False,
        )
    for cand in shown:
        memory = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in cand.prediction.memory.items())
        console.print(f"memory per GPU, {_short(cand)}: {memory}", highlight=False)
    console.print(
        f"[dim]{CHEAPEST}; {result.fitting} of {result.considered} layouts predicted fit; model: "
        f"{result.calibration.describe()}; peak {human(cluster.peak)}FLOP/s bf16[/]",
        highlight=False,
    )
    if launch is None:
        console.print(
            f"[dim]no launch lines, {not_launchable(c)} (yamlformer.builder.analysis.runtime); --launchable plans only "
            "layouts the recipes run, with lines[/]",
            highlight=False,
        )
        return
    print_launch(console, result, launch)


def _short(c) -> str:
    lay = c.layout
    dims = [
        f"{name}{degree}"
        for name, degree in (
            ("TP", lay.tensor_parallel),
            ("PP", lay.pipeline_parallel),
            ("CP", lay.context_parallel),
            ("EP", lay.expert_parallel),
        )
        if degree > 1
    ]
    mode = {"shard": f"FSDP{lay.shard_size}", "hybrid": f"HSDP{lay.shard_size}x{lay.replicas}"}.get(
        lay.data_parallel, f"DP{lay.data_parallel_size}"
    )
    sched = f" {c.run.schedule}" if lay.pipeline_parallel > 1 else ""
    return f"{' '.join(dims + [mode])} mb{c.micro_batch} {c.recompute}{sched}"
