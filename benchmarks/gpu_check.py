"""The GPU check: FSDP2 in bf16 on a ~1B-parameter spec, memory against the estimate, and the
attention kernels, in one table (under 8 minutes on one H200).

    python benchmarks/gpu_check.py                 # the check
    python benchmarks/gpu_check.py --steps 10 --layers 4 --skip-attention   # a quick one
    python benchmarks/gpu_check.py --cpu --steps 2 --layers 1 --seq-len 64 --batch 2   # the script's plumbing, no GPU

It trains ``builder train``'s own recipe machinery (``trainer.strategy: fsdp``: the model built
on the meta device, one ``fully_shard`` unit per layer, bf16 parameters and compute with fp32
gradient reduction and fp32 master weights, a sharded checkpoint at the end) on the Python
standard library's source with a character vocabulary, then reports:

* tokens/s at the median step time and MFU (the analytic training FLOPs per token of
  ``builder.estimates`` over ``builder.mfu``'s dense bf16 peak for the device);
* ``torch.cuda.max_memory_allocated`` next to ``builder describe``'s training memory for the same
  layout, batch and sequence length (the estimate counts weights, gradients, AdamW state, FSDP's
  buffers and the saved activations; the allocator adds its own blocks and the loss's temporaries);
* the Triton attention kernels against SDPA's flash backend on a causal training shape and a
  decode shape (``benchmarks/attention.py``'s measurements, checked for correctness first).

Without CUDA it says so and exits 2 (``--cpu`` runs the same training on the CPU, without the
GPU memory and kernel rows: a check of the script itself). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec(layers: int) -> dict:
    """A Llama-style decoder: d_model 2048, 16 query / 8 key-value heads, SwiGLU 5632; ~1B
    parameters at 20 layers (the character vocabulary adds almost nothing)."""
    return {
        "name": f"gpu-check-{layers}x2048", "architecture": "decoder-only", "d_model": 2048, "max_seq_len": 4096,
        "position": {"type": "rope", "theta": 10000.0},
        "decoder": {"n_layers": layers, "attention": {"n_heads": 16, "n_kv_heads": 8},
                    "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 5632}, "norm": {"type": "rmsnorm"}},
    }


def recipe(folder: Path, args) -> Path:
    import yaml

    doc = {
        "name": "gpu-check",
        "model": {"spec": spec(args.layers)},
        "data": {"sources": ["python-stdlib"], "max_bytes": 4_000_000, "seq_len": args.seq_len,
                 "batch_size": args.batch, "cache_dir": str(folder / "cache")},
        "tokenizer": {"type": "char"},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.1},
        "schedule": {"type": "cosine", "warmup_steps": 5},
        "trainer": {"max_steps": args.steps, "val_check_interval": 10 * args.steps, "limit_val_batches": 1,
                    "checkpoint_every_n_steps": 10 * args.steps, "log_every_n_steps": 5,
                    "precision": "bf16-mixed", "strategy": "fsdp", "accelerator": "cpu" if args.cpu else "cuda",
                    "devices": 1, "activation_checkpointing": args.activation_checkpointing,
                    "output_dir": str(folder / "run")},
        "sample": {"max_new_tokens": 0},
    }
    path = folder / "gpu-check.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def estimates(path: Path, vocab_size: int, args) -> dict:
    """Parameters, training FLOPs per token and per-device training memory of the recipe's model."""
    from builder.estimates import estimate
    from recipes.config import load_recipe, model_spec

    loaded = load_recipe(path)
    model = model_spec(loaded, path, vocab_size)
    est = estimate(model, seq_len=args.seq_len, batch=args.batch, dtype="bf16", devices=1, strategy="fsdp",
                   activation_checkpointing=args.activation_checkpointing)
    return {"params": est.params.total, "flops_per_token": est.flops.train_per_token,
            "memory": est.memory.training_total, "activations": est.memory.activations}


def train(path: Path, cuda: bool) -> dict:
    import torch

    from recipes.train import run

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
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check of the script; no GPU rows)")
    args = parser.parse_args(argv)
    for name in ("steps", "layers", "batch", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("benchmarks/gpu_check.py needs a CUDA GPU and found none; run it on a GPU machine "
              "(--cpu runs the same training on the CPU, to check the script itself)", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from builder.mfu import peak_flops

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = recipe(Path(tmp), args)
        summary = train(path, cuda=not args.cpu)
        from builder.checkpoints import read_meta

        vocab = read_meta(Path(summary["last"]), check=False)["builder"]["spec"]["vocab_size"]
        est = estimates(path, vocab, args)
        kernels = [] if args.skip_attention or args.cpu else attention()
        device = "cpu" if args.cpu else torch.cuda.get_device_name()
    peak = peak_flops(device, "bf16")
    tokens_per_s = summary.get("tokens_per_s")
    mfu = tokens_per_s * est["flops_per_token"] / peak if tokens_per_s and peak else None
    allocated = summary.get("peak_allocated")

    rows = [
        ("device", device, ""),
        ("model", f"{est['params'] / 1e9:.2f}B parameters", f"{args.layers} layers x d_model 2048, seq {args.seq_len}, "
                                                             f"batch {args.batch}"),
        ("layout", "FSDP2 on 1 device, bf16-mixed", "fully_shard per layer; fp32 master weights and reduction"
                                                    + ("; activation checkpointing" if args.activation_checkpointing else "")),
        ("steps", str(summary.get("steps", "n/a")), f"{summary.get('run_seconds', 0):.0f} s for the whole run"),
        ("train loss", f"{summary['train_loss']:.3f}" if summary.get("train_loss") else "n/a", "last step"),
        ("tokens/s", f"{tokens_per_s:,.0f}" if tokens_per_s else "n/a", "median step"),
        ("MFU", f"{mfu:.1%}" if mfu else "n/a", f"{est['flops_per_token'] / 1e9:.2f} GFLOP/token over "
                                                 f"{peak / 1e12:.0f} TFLOP/s" if peak else "dense bf16 peak unknown"),
        ("memory, estimated", gib(est["memory"]), f"builder describe (activations {gib(est['activations'])})"),
        ("memory, max allocated", gib(allocated),
         f"{allocated / est['memory']:.2f} x the estimate" if allocated else "torch.cuda.max_memory_allocated"),
    ]
    for r in kernels:
        if "seq" in r:
            note = f"D {r['head_dim']}, seq {r['seq']}, causal {r['causal']}; max rel err {r['max_rel_err']:.1e}"
            ours, flash = r["ours_fwd_bwd"], r["flash_fwd_bwd"]
            rows.append(("attention fwd+bwd TFLOP/s", f"{ours:.0f} (flash {flash:.0f})" if ours and flash else "n/a",
                         note + ("" if r["ok"] else " FAIL")))
        else:
            note = f"batch {r['batch']}, cache {r['cache']}; max rel err {r['max_rel_err']:.1e}"
            ours, flash = r["ours_gbs"], r["flash_gbs"]
            rows.append(("attention decode GB/s", f"{ours:.0f} (flash {flash:.0f})" if ours and flash else "n/a",
                         note + ("" if r["ok"] else " FAIL")))
    print("\n| check | result | note |\n|---|---|---|")
    for name, value, note in rows:
        print(f"| {name} | {value} | {note} |")
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s in all")
    print(json.dumps({"device": device, "params": est["params"], "steps": summary.get("steps"),
                      "tokens_per_s": tokens_per_s, "mfu": mfu, "memory_estimate": est["memory"],
                      "max_memory_allocated": allocated, "seconds": seconds,
                      "attention": [{k: v for k, v in r.items()} for r in kernels]}))
    failed = [r for r in kernels if not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
