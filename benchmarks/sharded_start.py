"""Host memory of a sharded start against a whole-model build, on CPU processes.

    python benchmarks/sharded_start.py              # a ~300M-parameter spec, 4 processes
    python benchmarks/sharded_start.py --ranks 2 --layers 8

The whole-model build is what ``builder train`` did before FSDP2: ``build_model(spec)`` in fp32
on the CPU of every rank. The sharded start is what ``trainer.strategy: fsdp`` does now
(``yamlformer.recipes.parallel.parallelize`` on a mesh): the model built on the meta device, every layer, the
embedding and the head made ``fully_shard`` units over the ranks, and each rank drawing only its
own rows of every parameter. Each runs in fresh processes (the sharded one under gloo); each
reports its peak resident set size (``ru_maxrss``) and what it rose by from after the imports
(and the process group) to the end of the start: the model's own memory. The sharded start must
raise a rank's memory by well under half of what the whole build does. A checksum (each
parameter's sum, gathered by DTensor) confirms both started from the same values. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234


def spec_dict(layers: int, d_model: int, vocab: int) -> dict:
    """A GPT-style decoder: learned positions, GELU MLP, tied head (GPT-2 medium's shape at 22 layers)."""
    return {
        "name": f"start-{layers}x{d_model}",
        "architecture": "decoder-only",
        "vocab_size": vocab,
        "d_model": d_model,
        "max_seq_len": 1024,
        "tie_embeddings": True,
        "position": {"type": "learned"},
        "decoder": {
            "n_layers": layers,
            "attention": {"n_heads": d_model // 64, "qkv_bias": True, "out_bias": True},
            "ffn": {"type": "mlp", "activation": "gelu_tanh", "bias": True},
            "norm": {"type": "layernorm"},
        },
    }


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def whole(spec: dict) -> dict:
    """Build the whole model in this process, as every rank did before."""
    import torch

    from yamlformer.builder import build_model
    from yamlformer.builder.spec.schema import spec_model

    torch.set_num_threads(1)
    validated = spec_model().model_validate(spec)
    base = peak_mib()
    started = time.perf_counter()
    model = build_model(validated, init_seed=SEED)
    seconds = time.perf_counter() - started
    sums = {name: float(p.double().sum()) for name, p in model.named_parameters()}
    return {
        "peak_mib": peak_mib(),
        "rise_mib": peak_mib() - base,
        "seconds": seconds,
        "params": sum(p.numel() for p in model.parameters()),
        "sums": sums,
    }


def sharded(spec: dict) -> dict:
    """One rank of the sharded start (``torch.distributed.run`` set the rank and the world)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from yamlformer.builder import build_model
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.parallel import layout_of, local_bytes, parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    settings = TrainerSection(strategy="fsdp", accelerator="cpu", devices=world)
    mesh = device_mesh(layout_of(settings), "cpu")
    validated = spec_model().model_validate(spec)
    base = peak_mib()
    started = time.perf_counter()
    model = parallelize(
        build_model(validated, device="meta"), settings, mesh, init_seed=SEED, device=torch.device("cpu")
    )
    dist.barrier()
    seconds = time.perf_counter() - started
    peak, rise = peak_mib(), peak_mib() - base
    sums = {}
    for name, p in model.named_parameters():  # a parameter's sum over its shards (DTensor reduces)
        total = p.double().sum()
        sums[name] = float(total.full_tensor() if isinstance(total, DTensor) else total)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "peak_mib": peak,
        "rise_mib": rise,
        "seconds": seconds,
        "local_mib": local_bytes(model) / 2**20,
        "sums": sums,
    }


def _child(mode: str, spec: dict, out: Path, ranks: int) -> None:
    env = dict(
        os.environ,
        PYTHONSAFEPATH="1",
        OMP_NUM_THREADS="1",
    )
    args = [__file__, "--worker", mode, "--spec", json.dumps(spec), "--out", str(out)]
    if mode == "whole":
        command = [sys.executable, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the {mode} start failed:\n{done.stderr[-3000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes of the sharded start (default 4)")
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (default 22: ~300M parameters)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worker", choices=("whole", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = (whole if args.worker == "whole" else sharded)(json.loads(args.spec))
        name = "whole" if args.worker == "whole" else f"rank{result['rank']}"
        Path(args.out, f"{name}.json").write_text(json.dumps(result))
        return 0
    if args.ranks < 2:
        parser.error("--ranks: at least 2")
    spec = spec_dict(args.layers, args.d_model, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _child("whole", spec, out, 1)
        _child("sharded", spec, out, args.ranks)
        full = json.loads((out / "whole.json").read_text())
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    mismatch = max(abs(r - full["sums"][k]) / max(1.0, abs(full["sums"][k])) for k, r in ranks[0]["sums"].items())
    print(
        f"{spec['name']}: {full['params'] / 1e6:.1f}M parameters "
        f"({full['params'] * 4 / 2**20:,.0f} MiB in fp32), {args.ranks} CPU processes (gloo)\n"
    )
    print("| start | peak RSS MiB | rise after imports MiB | parameters held MiB | seconds |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| whole model, one process | {full['peak_mib']:,.0f} | {full['rise_mib']:,.0f} "
        f"| {full['params'] * 4 / 2**20:,.0f} | {full['seconds']:.1f} |"
    )
    for r in ranks:
        print(
            f"| sharded, rank {r['rank']} | {r['peak_mib']:,.0f} | {r['rise_mib']:,.0f} "
            f"| {r['local_mib']:,.0f} | {r['seconds']:.1f} |"
        )
    share = max(r["rise_mib"] for r in ranks) / full["rise_mib"]
    peak_share = max(r["peak_mib"] for r in ranks) / full["peak_mib"]
    print(
        f"\nlargest sharded rank / whole build: {share:.2f} of the start's rise, {peak_share:.2f} of peak RSS "
        f"(imports included); parameter sums agree to {mismatch:.1e}"
    )
    print(
        json.dumps(
            {
                "params": full["params"],
                "ranks": args.ranks,
                "whole_peak_mib": full["peak_mib"],
                "whole_rise_mib": full["rise_mib"],
                "sharded_peak_mib": [r["peak_mib"] for r in ranks],
                "sharded_rise_mib": [r["rise_mib"] for r in ranks],
                "rise_ratio": share,
                "peak_ratio": peak_share,
                "max_sum_rel_diff": mismatch,
            }
        )
    )
    return 0 if share < 0.5 and mismatch < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
