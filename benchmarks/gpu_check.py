"""The GPU check: FSDP2 in bf16 on a ~1B-parameter spec, memory against the estimate, the
attention kernels, and every shipped recipe trained a few steps in its ``auto`` precision.

    python benchmarks/gpu_check.py                 # the check
    python benchmarks/gpu_check.py --steps 10 --layers 4 --skip-attention --recipe-steps 10   # a quick one
    python benchmarks/gpu_check.py --skip-recipes  # the FSDP and kernel rows only (under 8 minutes on one H200)
    python benchmarks/gpu_check.py --cpu --steps 2 --layers 1 --seq-len 64 --batch 2   # the script's plumbing, no GPU

It trains ``builder train``'s own recipe machinery (``trainer.strategy: fsdp``: the model built
on the meta device, one ``fully_shard`` unit per layer, bf16 parameters and compute with fp32
gradient reduction and fp32 master weights, a sharded checkpoint at the end) on the Python
standard library's source with a character vocabulary, then reports:

* tokens/s at the median step time and MFU (the analytic training FLOPs per token of
  ``yamlformer.builder.analysis.estimates`` over ``yamlformer.builder.analysis.mfu``'s dense bf16 peak for the device);
* ``torch.cuda.max_memory_allocated`` next to ``builder describe``'s training memory for the same
  layout, batch and sequence length (the estimate counts weights, gradients, AdamW state, FSDP's
  buffers and the saved activations; the allocator adds its own blocks and the loss's temporaries);
* the Triton attention kernels against SDPA's flash backend on a causal training shape and a
  decode shape (``benchmarks/attention.py``'s measurements, checked for correctness first);
* the performance model's kernel efficiencies at the published runs' shapes (``benchmarks/
  perf_kernels.py``: bf16 and float8 GEMMs of 8B/70B/405B layers, ring-attention steps; about
  10^15 FLOPs, estimated well under a minute and not yet run on a GPU, added after the 8 minutes
  above were measured; ``--skip-perf-kernels`` leaves them out).

Then every shipped recipe (``recipes/*.yaml``, the zoo's recipes) trains ``--recipe-steps`` steps
(default 20) as ``builder train`` runs it, with ``trainer.precision: auto``, no ``max_time``, one
validation at the end, a throughput interval of a fifth of the steps (the median leaves the warm-up
and compilation out) and a temporary output folder: on one GPU, and on all of them under
``strategy: ddp`` when there are several (with one GPU that row is left out, and the output says so).
Each row is its own process (Lightning starts a DDP row's other ranks as copies of it) with a time
limit, so one that fails or hangs fails alone. A row reports the precision ``auto`` resolved to,
the steps done, whether the final training loss is finite, tokens/s (all devices, median interval)
and ok, failed (with the error's one line) or ``skipped: no data``: the recipes fetch their data
through the dataset registry (``recipes/data/registry.py``: ``BUILDER_DATA``, set here to a checkout's
``../shared/data`` when there is one, else the user cache, downloading what is missing), and a
machine that can neither find nor download it skips the recipe.

Without CUDA it says so and exits 2 (``--cpu`` runs the same training on the CPU, without the
GPU memory and kernel rows, and the recipe rows on the CPU, one device, 2 steps: a check of the
script itself). It exits 1 when a kernel or a recipe row failed. The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if (REPO.parent / "shared" / "data").is_dir():  # a checkout's local data copies, else the download path
    os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))

#: Lightning's launch variables, which the in-process FSDP run leaves in this process's environment:
#: a child that inherits ``LOCAL_RANK`` takes itself for a rank started by a launcher and starts no others
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: seconds one recipe row may take (a hung DDP rendezvous fails its row, not the whole check)
ROW_TIMEOUT = 600


def spec(layers: int) -> dict:
    """A Llama-style decoder: d_model 2048, 16 query / 8 key-value heads, SwiGLU 5632; ~1B
    parameters at 20 layers (the character vocabulary adds almost nothing)."""
    return {
        "name": f"gpu-check-{layers}x2048",
        "architecture": "decoder-only",
        "d_model": 2048,
        "max_seq_len": 4096,
        "position": {"type": "rope", "theta": 10000.0},
        "decoder": {
            "n_layers": layers,
            "attention": {"n_heads": 16, "n_kv_heads": 8},
            "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 5632},
            "norm": {"type": "rmsnorm"},
        },
    }


def recipe(folder: Path, args) -> Path:
    import yaml

    doc = {
        "name": "gpu-check",
        "model": {"spec": spec(args.layers)},
        "data": {
            "sources": ["python-stdlib"],
            "max_bytes": 4_000_000,
            "seq_len": args.seq_len,
            "batch_size": args.batch,
            "cache_dir": str(folder / "cache"),
        },
        "tokenizer": {"type": "char"},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.1},
        "schedule": {"type": "cosine", "warmup_steps": 5},
        "trainer": {
            "max_steps": args.steps,
            "val_check_interval": 10 * args.steps,
            "limit_val_batches": 1,
            "checkpoint_every_n_steps": 10 * args.steps,
            "log_every_n_steps": 5,
            "precision": "bf16-mixed",
            "strategy": "fsdp",
            "accelerator": "cpu" if args.cpu else "cuda",
            "devices": 1,
            "activation_checkpointing": args.activation_checkpointing,
            "output_dir": str(folder / "run"),
        },
        "sample": {"max_new_tokens": 0},
    }
    path = folder / "gpu-check.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def estimates(path: Path, vocab_size: int, args) -> dict:
    """Parameters, training FLOPs per token and per-device training memory of the recipe's model."""
    from yamlformer.builder.analysis.estimates import Step, estimate
    from yamlformer.builder.analysis.layout import Layout
    from yamlformer.recipes.recipe.sections import load_recipe, model_spec

    loaded = load_recipe(path)
    model = model_spec(loaded, path, vocab_size)
    step = Step(
        seq_len=args.seq_len, batch=args.batch, dtype="bf16", activation_checkpointing=args.activation_checkpointing
    )
    est = estimate(model, step, Layout(devices=1, strategy="fsdp"))
    return {
        "params": est.params.total,
        "flops_per_token": est.flops.train_per_token,
        "memory": est.memory.training_total,
        "activations": est.memory.activations,
    }


def train(path: Path, cuda: bool) -> dict:
    import torch

    from yamlformer.recipes.training.run import run

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    summary = run(path, samples=False)
    summary["peak_allocated"] = torch.cuda.max_memory_allocated() if cuda else None
    summary["run_seconds"] = time.perf_counter() - started
    return summary


def attention() -> list[dict]:
    """A causal training shape and a decode shape, ours against SDPA's flash backend."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from attention import decode_rows, training_rows

    torch.manual_seed(0)
    rows = training_rows((128,), (4096,), (True,), torch.bfloat16)
    rows += decode_rows((8,), (16384,), torch.bfloat16, 4800.0)
    return rows


def shipped_recipes() -> list[str]:
    """The zoo's recipes by name (``recipes/*.yaml``)."""
    from yamlformer.builder.zoo import entries

    return [e.name for e in entries().values() if e.kind == "recipe"]


def recipe_overrides(folder: Path, steps: int, devices: int, cpu: bool) -> dict:
    """What a recipe row forces (the module doc); ``devices`` above 1 under DDP."""
    return {
        "trainer.precision": "auto",
        "trainer.max_time": None,
        "trainer.max_steps": steps,
        "trainer.val_check_interval": steps,
        "trainer.log_every_n_steps": max(1, steps // 5),
        "trainer.accelerator": "cpu" if cpu else "cuda",
        "trainer.devices": devices,
        **({"trainer.strategy": "ddp"} if devices > 1 else {}),
        "trainer.output_dir": str(folder / "run"),
    }


def recipe_worker(name: str, overrides: dict, result: Path) -> None:
    """One recipe row, in its own process (a DDP row's other ranks run it too): ``yamlformer.recipes.training.run.run``
    as ``builder train`` calls it; rank 0 writes what came of it to ``result``."""
    from yamlformer.recipes.data.registry import DatasetError
    from yamlformer.recipes.recipe.sections import load_recipe, recipe_path
    from yamlformer.recipes.training.module import NonFiniteLossError
    from yamlformer.recipes.training.run import for_this_machine, run

    row: dict = {"precision": None, "steps": None, "train_loss": None, "finite": None, "tokens_per_s": None}
    try:
        path = recipe_path(name)
        row["precision"] = for_this_machine(load_recipe(path, overrides), quiet=True).trainer.precision
        summary = run(path, overrides, fresh=True, samples=False)
        loss = summary["train_loss"]
        row.update(
            steps=summary["steps"],
            train_loss=loss,
            finite=None if loss is None else math.isfinite(loss),
            tokens_per_s=summary["tokens_per_s"],
            status="ok",
        )
    except DatasetError as exc:  # not on disk and not downloadable here
        row.update(status="skipped: no data", error=str(exc).splitlines()[0][:300])
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0]
        row.update(
            status="failed",
            error=f"{type(exc).__name__}: {text}"[:300],
            finite=False if isinstance(exc, NonFiniteLossError) else None,
        )
    if os.environ.get("LOCAL_RANK", "0") == "0":
        result.write_text(json.dumps(row))


def recipe_row(name: str, devices: int, steps: int, cpu: bool, tmp: Path) -> dict:
    """One recipe row: :func:`recipe_worker` in a child process (working directory ``tmp``, where
    the tokenizer caches go), killed with its ranks after :data:`ROW_TIMEOUT` seconds."""
    folder = tmp / f"{name}-{devices}"
    folder.mkdir()
    result, log = folder / "result.json", folder / "output.txt"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--recipe-worker",
        name,
        json.dumps(recipe_overrides(folder, steps, devices, cpu)),
        str(result),
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    started, timed_out = time.perf_counter(), False
    with open(log, "wb") as out:
        child = subprocess.Popen(
            command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            child.wait(timeout=ROW_TIMEOUT)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)  # its session: the DDP ranks Lightning started too
            child.wait()
    row = {"recipe": name, "devices": devices, "seconds": time.perf_counter() - started}
    if result.is_file():
        return row | json.loads(result.read_text())
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = (
        f"timed out after {ROW_TIMEOUT} s"
        if timed_out
        else lines[-1].strip()[:300]
        if lines
        else f"exit status {child.returncode}"
    )
    return row | {
        "precision": None,
        "steps": None,
        "train_loss": None,
        "finite": None,
        "tokens_per_s": None,
        "status": "failed",
        "error": error,
    }


def recipes_section(args) -> tuple[list[dict], str | None]:
    """Every shipped recipe on one device and, with several GPUs, on all of them; and a note on
    the all-GPU rows when there are none."""
    import torch

    steps = args.recipe_steps or (2 if args.cpu else 20)
    if args.cpu:
        counts, note = [1], "all-device rows: not run with --cpu"
    else:
        gc.collect()
        torch.cuda.empty_cache()  # the FSDP run's cached blocks, for the rows' processes
        gpus = torch.cuda.device_count()
        counts = [1, gpus] if gpus > 1 else [1]
        note = None if gpus > 1 else "all-GPU rows: skipped, this machine has one GPU"
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-recipes-") as tmp:
        for name in shipped_recipes():
            for devices in counts:
                if rows and rows[-1]["recipe"] == name and rows[-1]["status"] == "skipped: no data":
                    rows.append(dict(rows[-1], devices=devices, seconds=0.0))  # the same data is missing
                    continue
                rows.append(recipe_row(name, devices, steps, args.cpu, Path(tmp)))
                r = rows[-1]
                print(
                    f"recipe {name} on {devices} device{'s' * (devices > 1)}: {r['status']} ({r['seconds']:.0f} s)",
                    flush=True,
                )
    return rows, note


def recipe_table(rows: list[dict], note: str | None) -> None:
    print(
        "\n| recipe | devices | precision (auto) | steps | final train loss | tokens/s | result |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        finite = r["finite"]
        loss = "n/a" if finite is None else f"{r['train_loss']:.3f} (finite)" if finite else "not finite"
        steps = "n/a" if r["steps"] is None else r["steps"]
        tokens = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        result = r["status"] + (f": {r['error']}" if r.get("error") else "")
        print(
            f"| {r['recipe']} | {r['devices']} | {r['precision'] or 'n/a'} | {steps} | {loss} | {tokens} | {result} |"
        )
    if note:
        print(f"\n{note}")


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (default 20: ~1B parameters)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--skip-attention", action="store_true", help="leave out the attention kernel benchmark")
    parser.add_argument("--recipe-steps", type=int, help="steps of each recipe row (default 20; 2 with --cpu)")
    parser.add_argument("--skip-recipes", action="store_true", help="leave out the shipped recipes' rows")
    parser.add_argument(
        "--skip-perf-kernels",
        action="store_true",
        help="leave out benchmarks/perf_kernels.py's rows (estimated under a minute)",
    )
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check of the script; no GPU rows)")
    parser.add_argument("--recipe-worker", nargs=3, metavar=("RECIPE", "OVERRIDES", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recipe_worker:
        name, overrides, result = args.recipe_worker
        recipe_worker(name, json.loads(overrides), Path(result))
        return 0
    for name in ("steps", "layers", "batch", "seq_len", "recipe_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(
            "benchmarks/gpu_check.py needs a CUDA GPU and found none; run it on a GPU machine "
            "(--cpu runs the same training on the CPU, to check the script itself)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from yamlformer.builder.analysis.mfu import peak_flops

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = recipe(Path(tmp), args)
        summary = train(path, cuda=not args.cpu)
        from yamlformer.builder.checkpoints import peek_meta

        vocab = peek_meta(Path(summary["last"]))["builder"]["spec"]["vocab_size"]
        est = estimates(path, vocab, args)
        kernels = [] if args.skip_attention or args.cpu else attention()
        device = "cpu" if args.cpu else torch.cuda.get_device_name()
    recipe_rows, recipe_note = ([], None) if args.skip_recipes else recipes_section(args)
    peak = peak_flops(device, "bf16")
    tokens_per_s = summary.get("tokens_per_s")
    mfu = tokens_per_s * est["flops_per_token"] / peak if tokens_per_s and peak else None
    allocated = summary.get("peak_allocated")

    rows = [
        ("device", device, ""),
        (
            "model",
            f"{est['params'] / 1e9:.2f}B parameters",
            f"{args.layers} layers x d_model 2048, seq {args.seq_len}, batch {args.batch}",
        ),
        (
            "layout",
            "FSDP2 on 1 device, bf16-mixed",
            "fully_shard per layer; fp32 master weights and reduction"
            + ("; activation checkpointing" if args.activation_checkpointing else ""),
        ),
        ("steps", str(summary.get("steps", "n/a")), f"{summary.get('run_seconds', 0):.0f} s for the whole run"),
        ("train loss", f"{summary['train_loss']:.3f}" if summary.get("train_loss") else "n/a", "last step"),
        ("tokens/s", f"{tokens_per_s:,.0f}" if tokens_per_s else "n/a", "median step"),
        (
            "MFU",
            f"{mfu:.1%}" if mfu else "n/a",
            f"{est['flops_per_token'] / 1e9:.2f} GFLOP/token over {peak / 1e12:.0f} TFLOP/s"
            if peak
            else "dense bf16 peak unknown",
        ),
        ("memory, estimated", gib(est["memory"]), f"builder describe (activations {gib(est['activations'])})"),
        (
            "memory, max allocated",
            gib(allocated),
            f"{allocated / est['memory']:.2f} x the estimate" if allocated else "torch.cuda.max_memory_allocated",
        ),
    ]
    for r in kernels:
        if "seq" in r:
            note = f"D {r['head_dim']}, seq {r['seq']}, causal {r['causal']}; max rel err {r['max_rel_err']:.1e}"
            ours, flash = r["ours_fwd_bwd"], r["flash_fwd_bwd"]
            rows.append(
                (
                    "attention fwd+bwd TFLOP/s",
                    f"{ours:.0f} (flash {flash:.0f})" if ours and flash else "n/a",
                    note + ("" if r["ok"] else " FAIL"),
                )
            )
        else:
            note = f"batch {r['batch']}, cache {r['cache']}; max rel err {r['max_rel_err']:.1e}"
            ours, flash = r["ours_gbs"], r["flash_gbs"]
            rows.append(
                (
                    "attention decode GB/s",
                    f"{ours:.0f} (flash {flash:.0f})" if ours and flash else "n/a",
                    note + ("" if r["ok"] else " FAIL"),
                )
            )
    print("\n| check | result | note |\n|---|---|---|")
    for name, value, note in rows:
        print(f"| {name} | {value} | {note} |")
    if not args.skip_recipes:
        recipe_table(recipe_rows, recipe_note)
    perf = None
    if not (args.cpu or args.skip_perf_kernels):  # the performance model's kernel efficiencies
        import perf_kernels

        print("\n## The performance model's constants at the published runs' shapes (benchmarks/perf_kernels.py)\n")
        perf = perf_kernels.measure()
        perf_kernels.print_tables(perf)
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s in all")
    print(
        json.dumps(
            {
                "device": device,
                "params": est["params"],
                "steps": summary.get("steps"),
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "memory_estimate": est["memory"],
                "max_memory_allocated": allocated,
                "seconds": seconds,
                "attention": [dict(r.items()) for r in kernels],
                "recipes": recipe_rows,
                "recipes_note": recipe_note,
                "perf_kernels": perf,
            }
        )
    )
    failed = [r for r in kernels if not r["ok"]] + [r for r in recipe_rows if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
