"""Benchmark the Triton attention kernels against PyTorch SDPA's flash and cuDNN backends.

Run on a CUDA machine from the repository root:

    python benchmarks/attention.py            # full run (a few minutes on an H200)
    python benchmarks/attention.py --quick    # a short run
    python benchmarks/attention.py --json     # machine-readable results
    python benchmarks/attention.py --sweep --json sweep.json --write-table   # every kernel config
    python benchmarks/attention.py --write-table --from-json sweep.json      # the table from a saved sweep
    python benchmarks/attention.py --sweep --cpu   # the sweep's plumbing under the interpreter

``--sweep`` (``attention_sweep.py``) times every kernel and launch config of the GPU's generation
and ours against SDPA and FlexAttention, under ``--budget`` seconds, printing a table row as each is
measured and, last, one line of JSON (every row and the table made from them, as ``--json PATH``
writes it); ``--write-table`` merges what it measured into ``kernels/attention_tuning.yaml`` (or the
given path).

Training shapes: bf16, head_dim in {64, 128}, causal and not, seq 512..16k, with
batch * seq = 16k tokens and n_heads * head_dim = 2048. Each shape is checked for correctness
(output and gradients against SDPA's flash backend) before it is timed. TFLOP/s use the
FlashAttention convention: forward = 4 * B * H * S^2 * D (halved when causal), forward +
backward = 3.5 x forward (the backward recomputes Q K^T). Timings are medians from
``triton.testing.do_bench``.

Decode shapes: one query token per sequence against a KV cache (GQA 32/8 heads, head_dim 128),
batch 8..64, cache 1k..32k; bandwidth counts the K and V cache read once, against the HBM
ceiling (4.8 TB/s for an H200, ``--peak-gbs`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from attention_sweep import sdpa_backend, sweep, table_from_rows  # gpu_check and perf_kernels import these here

TOKENS = 16384  # batch * seq for the training shapes
WIDTH = 2048  # n_heads * head_dim for the training shapes
FWD_BWD_FACTOR = 3.5  # forward + backward FLOPs over forward FLOPs (FlashAttention convention)
TOLERANCE = 3e-2  # max |ours - flash| / max |flash| accepted in bf16


def ours(q, k, v, causal):
    from yamlformer.kernels import Mask, attention

    return attention(q, k, v, Mask(causal=causal), backend="triton")


def timed(fn, grad_to_none=None):
    """Median milliseconds, or None when the backend cannot run this shape."""
    import triton.testing

    try:
        fn()  # compile / autotune outside the timing
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    except RuntimeError:
        return None


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def check(q, k, v, causal):
    """Max relative error of our output and gradients against SDPA flash (inf if it fails)."""
    dout = torch.randn_like(q)
    results = []
    for fn in (ours, sdpa_backend("flash")):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, causal)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    return max(rel_err(a, b) for a, b in zip(*results))


def training_rows(head_dims, seqs, causals, dtype):
    rows = []
    for head_dim in head_dims:
        for causal in causals:
            for seq in seqs:
                batch, heads = max(1, TOKENS // seq), WIDTH // head_dim
                shape = (batch, heads, seq, head_dim)
                q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
                err = check(q, k, v, causal)
                flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
                row = dict(
                    head_dim=head_dim,
                    causal=causal,
                    seq=seq,
                    batch=batch,
                    heads=heads,
                    max_rel_err=err,
                    ok=err < TOLERANCE,
                )
                fns = {"ours": ours, "flash": sdpa_backend("flash"), "cudnn": sdpa_backend("cudnn")}
                for name, fn in fns.items():
                    ms = timed(lambda: fn(q, k, v, causal))
                    row[f"{name}_fwd"] = None if ms is None else flops / ms * 1e-9
                    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                    dout = torch.randn_like(q)
                    ms = timed(lambda: fn(*leaves, causal).backward(dout), grad_to_none=leaves)
                    row[f"{name}_fwd_bwd"] = None if ms is None else FWD_BWD_FACTOR * flops / ms * 1e-9
                rows.append(row)
                print(
                    f"  D={head_dim} causal={causal} S={seq}: ours {fmt(row['ours_fwd'])} / "
                    f"{fmt(row['ours_fwd_bwd'])} TFLOP/s, err {err:.1e}",
                    file=sys.stderr,
                )
                del q, k, v
    return rows


def decode_rows(batches, caches, dtype, peak_gbs):
    rows = []
    heads, kv_heads, head_dim = 32, 8, 128
    for batch in batches:
        for cache in caches:
            q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, kv_heads, cache, head_dim, device="cuda", dtype=dtype) for _ in range(2))
            ref = sdpa_backend("flash")
            try:
                err = rel_err(ours(q, k, v, False), ref(q, k, v, False))
            except RuntimeError:  # flash without GQA support: compare with expanded heads
                group = heads // kv_heads
                err = rel_err(
                    ours(q, k, v, False), ref(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)
                )
            gbytes = 2 * k.numel() * k.element_size() * 1e-9  # K and V read once
            row = dict(batch=batch, cache=cache, max_rel_err=err, ok=err < TOLERANCE)
            for name, fn in (("ours", ours), ("flash", sdpa_backend("flash")), ("cudnn", sdpa_backend("cudnn"))):
                ms = timed(lambda: fn(q, k, v, False))
                row[f"{name}_gbs"] = None if ms is None else gbytes / ms * 1e3
            row["ours_pct_peak"] = None if row["ours_gbs"] is None else 100.0 * row["ours_gbs"] / peak_gbs
            rows.append(row)
            print(
                f"  decode B={batch} cache={cache}: ours {fmt(row['ours_gbs'], 0)} GB/s, err {err:.1e}", file=sys.stderr
            )
            del q, k, v
    return rows


def fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def print_tables(train, decode, peak_gbs):
    print("\n## Training attention (bf16, TFLOP/s, median)\n")
    print(
        "| D | causal | S | B x H | ours fwd | flash fwd | cudnn fwd | vs flash | vs cudnn "
        "| ours f+b | flash f+b | cudnn f+b | vs flash | vs cudnn | max rel err |"
    )
    print("|" + "---|" * 15)
    for r in train:
        print(
            f"| {r['head_dim']} | {r['causal']} | {r['seq']} | {r['batch']} x {r['heads']} "
            f"| {fmt(r['ours_fwd'])} | {fmt(r['flash_fwd'])} | {fmt(r['cudnn_fwd'])} "
            f"| {ratio(r['ours_fwd'], r['flash_fwd'])} | {ratio(r['ours_fwd'], r['cudnn_fwd'])} "
            f"| {fmt(r['ours_fwd_bwd'])} | {fmt(r['flash_fwd_bwd'])} | {fmt(r['cudnn_fwd_bwd'])} "
            f"| {ratio(r['ours_fwd_bwd'], r['flash_fwd_bwd'])} "
            f"| {ratio(r['ours_fwd_bwd'], r['cudnn_fwd_bwd'])} "
            f"| {r['max_rel_err']:.1e}{'' if r['ok'] else ' FAIL'} |"
        )
    print(f"\n## Decode (1 query token, 32/8 heads, D=128, GB/s of KV cache read; ceiling {peak_gbs:.0f} GB/s)\n")
    print("| batch | cache | ours | flash | cudnn | vs flash | vs cudnn | ours % of ceiling | max rel err |")
    print("|" + "---|" * 9)
    for r in decode:
        print(
            f"| {r['batch']} | {r['cache']} | {fmt(r['ours_gbs'], 0)} | {fmt(r['flash_gbs'], 0)} "
            f"| {fmt(r['cudnn_gbs'], 0)} | {ratio(r['ours_gbs'], r['flash_gbs'])} "
            f"| {ratio(r['ours_gbs'], r['cudnn_gbs'])} | {fmt(r['ours_pct_peak'])} "
            f"| {r['max_rel_err']:.1e}{'' if r['ok'] else ' FAIL'} |"
        )


def write_table(result: dict, path) -> Path:
    """Merge a sweep's table (``table_from_rows``) into the tuning table at ``path`` (the shipped
    one when not given; a new file starts from the shipped one)."""
    from yamlformer.kernels import tuning

    path = Path(path) if path else tuning.TABLE_PATH
    current = tuning._load_table(str(path if path.exists() else tuning.TABLE_PATH))
    table = tuning.updated_table(current, result["generation"], result["chosen"], result["prefer"], result["failed"])
    return tuning.write_table(table, path)


def run_sweep(args) -> int:
    text = None
    if args.from_json is not None:
        result = json.loads(Path(args.from_json).read_text())["table"]
    else:
        if not args.cpu and not torch.cuda.is_available():
            print("--sweep needs a CUDA GPU (none found); --sweep --cpu runs its plumbing", file=sys.stderr)
            return 2
        rows = sweep(cpu=args.cpu, budget_s=args.budget)
        result = table_from_rows(rows)
        device = "the Triton interpreter" if args.cpu else torch.cuda.get_device_name()
        text = json.dumps({"device": device, "rows": rows, "table": result})
        if args.json not in (None, "-"):
            Path(args.json).write_text(text)
    if args.write_table is not None:
        print(f"wrote {write_table(result, args.write_table or None)}", file=sys.stderr)
    if text is not None:
        print(text)  # the last line: what a caller (gpu_check's attention section) reads
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a few shapes)")
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="PATH", help="results as JSON: to PATH, or printed without one"
    )
    parser.add_argument(
        "--peak-gbs", type=float, default=4800.0, help="HBM bandwidth ceiling in GB/s (default: H200, 4800)"
    )
    parser.add_argument("--sweep", action="store_true", help="time every kernel config and backend (attention_sweep)")
    parser.add_argument("--cpu", action="store_true", help="with --sweep: its plumbing on the CPU, interpreted")
    parser.add_argument(
        "--budget",
        type=float,
        default=130.0,
        help="with --sweep: seconds it may take (default 130: inside gpu_check's section; 280 covers every case)",
    )
    parser.add_argument(
        "--write-table",
        nargs="?",
        const="",
        metavar="PATH",
        help="merge the sweep's configs and preferences into kernels/attention_tuning.yaml (or PATH)",
    )
    parser.add_argument("--from-json", metavar="PATH", help="with --write-table: take the sweep from this --json file")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.write_table is not None and not (args.sweep or args.from_json):
        parser.error("--write-table needs --sweep or --from-json")
    if args.cpu and args.write_table == "":
        parser.error("--cpu --write-table needs a PATH: interpreter timings do not belong in the shipped table")
    if args.sweep or args.from_json:
        return run_sweep(args)
    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA GPU (none found); the CPU test suite "
            "(tests/test_kernels.py) covers correctness without one.",
            file=sys.stderr,
        )
        return 2
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if args.quick:
        train = training_rows((128,), (1024, 4096), (False, True), dtype)
        decode = decode_rows((8,), (4096, 16384), dtype, args.peak_gbs)
    else:
        train = training_rows((64, 128), (512, 1024, 2048, 4096, 8192, 16384), (False, True), dtype)
        decode = decode_rows((8, 64), (1024, 4096, 16384, 32768), dtype, args.peak_gbs)
    if args.json is not None:
        text = json.dumps({"device": torch.cuda.get_device_name(), "training": train, "decode": decode}, indent=2)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    else:
        print(f"\nDevice: {torch.cuda.get_device_name()}")
        print_tables(train, decode, args.peak_gbs)
    failed = [r for r in train + decode if not r["ok"]]
    if failed:
        print(f"\n{len(failed)} shape(s) failed the correctness check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
