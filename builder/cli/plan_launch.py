"""``builder plan``'s launch: the ``torchrun`` and SLURM lines of the plan's layout, and the batch
file ``--sbatch FILE`` writes (``yamlformer.builder.analysis.sbatch``: pre-emptible, requeued by the
run itself, ``--gres`` left out with ``--no-gres`` on CPU nodes); the options that shape them.
Torch-free.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from yamlformer.builder.analysis.launch import Launch, launch_lines
from yamlformer.builder.analysis.report import human
from yamlformer.builder.analysis.sbatch import sbatch_script
from yamlformer.builder.kinds import kind_of
from yamlformer.builder.spec.loader import SpecError, read_merged
from yamlformer.builder.zoo import ZooError, locate

DEFAULT_RECIPE = "lm-stdlib.yaml"  # of the recipes package


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--sbatch",
        metavar="FILE",
        help="write the launch as a SLURM batch file: SIGUSR1 120 s before the time limit saves and requeues "
        "(--signal, --requeue), a rank that dies ends the job (srun --kill-on-bad-exit=1), the log appended "
        "across requeues (--open-mode=append), this Python's environment activated; `sbatch FILE` runs it (default: "
        "none written; --json has it as launch.sbatch)",
    )
    parser.add_argument(
        "--no-gres",
        action="store_true",
        help="the batch file asks for no GPUs (no --gres line): a cluster of CPU nodes, one rank per task on gloo",
    )
    parser.add_argument(
        "--activate",
        metavar="LINE",
        help="the batch file's line that makes `builder` found on every node (default: this Python's "
        "environment: its `activate`, `conda activate`, or its bin folder on PATH)",
    )


def recipe_document(recipe: str | None):
    """How the launch lines name the recipe — a zoo name as given (``lm-stdlib``, the default),
    a file as an absolute path, so a line runs from any folder — its document kind, which turns
    a plan into the recipe's settings (``yamlformer.builder.kinds``), and the merged file (not validated:
    ``builder train`` does that)."""
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


def launch_of(result, args, tokens: int | None) -> dict:
    """The plan's launch: its ``torchrun`` and SLURM lines, the batch file (``sbatch``, written to
    ``--sbatch FILE`` when given), the ``--set`` flags, the ``builder describe`` line that checks
    its memory, and its steps and tokens. ``ValueError`` when the batch file cannot be written."""
    recipe, kind, document = recipe_document(args.recipe)
    spec = os.path.abspath(args.spec) if os.path.exists(args.spec) else args.spec  # a zoo name stays one
    budget = tokens if tokens is not None else CHINCHILLA_TOKENS_PER_PARAMETER * result.params
    max_steps = max(1, -(-budget // result.tokens_per_step))
    layout = result.chosen.layout
    launch = Launch(
        result.chosen,
        seq_len=result.seq_len,
        dtype=result.dtype,
        spec=spec,
        spec_overrides=(*args.overrides, *result.chosen.spec_overrides),
        max_steps=max_steps,
        output_dir=os.path.join("runs", f"{result.spec_name}-{layout.devices}gpus"),
    )
    sets = kind.launch(document, launch)
    lines = launch_lines(recipe, sets, layout)
    script = sbatch_script(
        f"builder {lines.pop('train')}",
        nodes=layout.nodes,
        tasks_per_node=layout.per_node,
        gpus_per_node=None if args.no_gres else layout.per_node,
        activate=args.activate,
    )
    if args.sbatch is not None:
        write_script(Path(args.sbatch), script)
    return {
        **lines,
        "sbatch": script,
        "sbatch_file": args.sbatch,
        "set": sets,
        "describe": _describe_line(result, args),
        "tokens": max_steps * result.tokens_per_step,
        "max_steps": max_steps,
        "output_dir": launch.output_dir,
        "budget": "--tokens" if tokens is not None else f"{CHINCHILLA_TOKENS_PER_PARAMETER} tokens per parameter",
    }


def _describe_line(result, args) -> str:
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
    for option, degree in (
        ("--context-parallel", layout.context_parallel),
        ("--expert-parallel", layout.expert_parallel),
    ):
        if degree > 1:
            parts += [option, str(degree)]
    if layout.pipeline_parallel > 1:
        parts += ["--pipeline-parallel", str(layout.pipeline_parallel), "--schedule", c.run.schedule]
        parts += ["--pipeline-microbatches", str(c.accumulation)]
    if result.src_len:
        parts += ["--src-len", str(result.src_len)]
    if c.checkpointing:
        parts.append("--checkpointing")
    if args.optimizer != "adamw":
        parts += ["--optimizer", args.optimizer]
    for item in [*args.overrides, *c.spec_overrides]:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


def write_script(path: Path, script: str) -> None:
    """Write the batch file (executable); ``ValueError`` names the file and what failed."""
    try:
        path.write_text(script)
        path.chmod(0o755)
    except OSError as exc:
        raise ValueError(f"--sbatch {path}: {exc.strerror or exc}") from None


def print_launch(console, result, launch: dict) -> None:
    """The plan's launch section of ``builder plan``'s text output."""
    console.print(
        f"\n[bold]launch[/] (torchrun on every node; or SLURM): {launch['max_steps']:,} steps of "
        f"{result.tokens_per_step:,} tokens, {human(launch['tokens'])} tokens ({launch['budget']}; "
        f"--tokens sets it), into ./{launch['output_dir']}",
        highlight=False,
    )
    console.print(launch["torchrun"], highlight=False, soft_wrap=True)
    console.print(launch["slurm"], highlight=False, soft_wrap=True)
    if launch["sbatch_file"] is not None:
        console.print(
            f"SLURM batch file written: sbatch {shlex.quote(launch['sbatch_file'])}", highlight=False, soft_wrap=True
        )
    else:
        console.print("[dim]--sbatch FILE writes it as a batch file (--json: launch.sbatch)[/]", highlight=False)
    console.print("check the memory with:", highlight=False)
    console.print(launch["describe"], highlight=False, soft_wrap=True)
    console.print(
        f"[dim]the recipe's tokenizer sets vocab_size; these figures use the spec's {result.params:,} parameters[/]",
        highlight=False,
    )
