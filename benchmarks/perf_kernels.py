"""The kernel rates behind the performance model, measured on the GPU it runs on.

``yamlformer.builder.analysis.perf`` times every GEMM and attention kernel at the rates a GPU's
calibration table measured (``builder/analysis/calibration/<gpu>.yaml``). This script prints, on
the GPU it runs on, what those rates are at the shapes one rank of each published run computes
(``benchmarks/plan_vs_published.py``), next to what the planner's table for the GPU says:

* **GEMMs**: every projection of one layer (forward ``x W^T``, the input gradient and the weight
  gradient), bf16 and float8 (``torch._scaled_mm``, per-tensor scales, as torchao's dynamic
  scaling calls it), for Llama 3.1 8B under FSDP (table 1: 2 x 8192 tokens a rank), 70B and 405B
  under TP 8 (tables 4 and 5: 16 x 8192 and 4 x 8192 tokens, each projection a TP rank's slice),
  as the FLOP-weighted rate of the layer's projections;
* **attention** (SDPA's flash backend, bf16, forward and backward): the ring steps of table 2 (8B
  with its keys and values repeated to 32 heads of 128, 32,768 tokens a rank: the causal first step,
  and the two half-work steps, queries against half the keys and half the queries against all),
  and a whole causal sequence of 8,192 tokens; FLOPs over the visible pairs, backward twice the forward.

``--write`` measures this GPU's whole calibration table instead (``yamlformer.builder.measure``:
a GEMM grid and the published layers' linears, bf16 and float8, the
attention backends at several lengths, the HBM bandwidth; about a minute on an H200) and writes it
where the planner reads the table shipped for this GPU (``builder/analysis/calibration/<gpu>.yaml``;
``--out DIR`` elsewhere). ``builder plan --calibrate`` does the same into the user's folder.

    python benchmarks/perf_kernels.py            # the published shapes on this GPU
    python benchmarks/perf_kernels.py --write    # refresh this GPU's table (an H200's: calibration/h200.yaml)
    python benchmarks/perf_kernels.py --cpu      # the script's plumbing at 1/64 of every size

The output is Markdown (for benchmarks/RESULTS.md); the last line is JSON. Without CUDA and
without ``--cpu`` it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from yamlformer.builder.analysis.calibration import SHIPPED, lookup
from yamlformer.builder.analysis.hardware import gpu
from yamlformer.builder.analysis.mfu import match_device
from yamlformer.builder.cli.arguments import count
from yamlformer.builder.measure import LAYERS, device_key, gemm_seconds, timed
from yamlformer.builder.measure import measure as measure_table

__all__ = ["LAYERS", "ATTENTION", "timed", "gemm_seconds", "device_peaks", "measure", "print_tables", "main"]

#: attention calls: (label, query tokens, key tokens, causal); 32 heads of 128 (8B's, repeated)
ATTENTION = [
    ("whole sequence 8,192, causal (table 1)", 8192, 8192, True),
    ("32,768 causal: table 2's CP 1, and ring step 0 at CP 2-8 (32,768 a rank)", 32768, 32768, True),
    ("ring step, queries x half the keys (table 2)", 32768, 16384, False),
    ("ring step, half the queries x all keys (table 2)", 16384, 32768, False),
]


def table_for(name: str):
    """``(key, hardware row, calibration)`` the planner uses for the device ``name`` (None: a
    device it knows nothing of)."""
    key = device_key(name)
    if key is None:
        return None
    return lookup(key)


def gemm_rows(peaks: dict, device: torch.device, scale: int, repeats: int, fp8: bool, planned) -> list[dict]:
    """Each published layer's projections timed together, bf16 (and float8): their rate, its
    fraction of the dense peak and what the planner's table for this GPU (``planned``) predicts."""
    rows = []
    for model, (tokens, projections) in LAYERS.items():
        for dtype in ("bf16", "fp8") if fp8 else ("bf16",):
            flops = seconds = table = 0.0
            for k, n in projections:
                m, k, n = tokens // scale, max(16, k // scale // 16 * 16), max(16, n // scale // 16 * 16)
                # forward x W^T, the input gradient dY W, the weight gradient dY^T X
                for shape in ((m, k, n), (m, n, k), (n, m, k)):
                    flops += 2 * shape[0] * shape[1] * shape[2]
                    seconds += gemm_seconds(*shape, dtype == "fp8", device, repeats)
                if planned is not None:
                    table += planned[2].linear_seconds(dtype, m, k, n, planned[1])
            rows.append(
                {
                    "model": model,
                    "dtype": dtype,
                    "tflops": flops / seconds / 1e12,
                    "of_peak": flops / seconds / peaks[dtype] if peaks.get(dtype) else None,
                    "table_tflops": flops / table / 1e12 if table else None,
                }
            )
    return rows


def attention_rows(peak: float | None, device: torch.device, scale: int, repeats: int, planned) -> list[dict]:
    """The flash backend at each of :data:`ATTENTION`'s calls: forward and backward rates, the
    fraction of the bf16 peak, and the planner's table's forward and backward."""
    from yamlformer.builder.measure import attention_rates, sdpa

    rows = []
    for label, q_len, k_len, causal in ATTENTION:
        q_len, k_len = q_len // scale, k_len // scale
        forward, backward = attention_rates(sdpa("flash"), q_len, k_len, causal, device, repeats)
        row = {"call": label, "forward_tflops": forward / 1e12, "backward_tflops": backward / 1e12}
        row["of_peak"] = 3 / (1 / forward + 2 / backward) / peak if peak else None
        if planned is not None:
            f, b = planned[2].attention_rates("flash", q_len, k_len, causal, planned[1])
            row["table"] = f"{f / 1e12:,.0f} / {b / 1e12:,.0f}"
        rows.append(row)
    return rows


def percent(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def device_peaks(name: str) -> dict:
    """Dense peak FLOP/s by dtype of the CUDA device ``name`` (its hardware-table row), {} for
    one the table does not know."""
    key = match_device(name)
    try:
        return gpu(key).peak if key is not None else {}
    except ValueError:  # a device the MFU table knows and the planner's hardware table does not
        return {}


def measure(cpu: bool = False, repeats: int = 10) -> dict:
    """Every row, on the GPU (``cpu``: on the CPU at 1/64 of every size): the device, its peaks and
    the GEMM and attention rows."""
    device = torch.device("cpu" if cpu else "cuda")
    name = "cpu" if cpu else torch.cuda.get_device_name()
    peaks = {} if cpu else device_peaks(name)
    planned = None if cpu else table_for(name)
    fp8 = cpu or "fp8" in peaks  # torch's CPU _scaled_mm runs the float8 rows' plumbing
    scale = 64 if cpu else 1
    torch.manual_seed(0)
    return {
        "device": name,
        "scale": scale,
        "peaks": {k: v for k, v in peaks.items() if k in ("bf16", "fp8")},
        "table": planned[2].source if planned is not None else None,
        "gemms": gemm_rows(peaks, device, scale, repeats, fp8, planned),
        "attention": attention_rows(peaks.get("bf16"), device, scale, repeats, planned),
    }


def print_tables(result: dict) -> None:
    peaks = ", ".join(f"{k} {v / 1e12:,.1f}" for k, v in result["peaks"].items()) or "unknown"
    torch_version = torch.__version__
    print(
        f"Device: {result['device']} (dense peak TFLOP/s, builder/analysis/hardware.py: {peaks}); torch {torch_version}"
    )
    if result["scale"] > 1:
        print(f"(every size / {result['scale']}: the script's plumbing, not a measurement of the model's GPUs)")
    print(f"The planner's table for it: {result['table'] or 'none'}")
    print("\n| one layer's projections | dtype | TFLOP/s | of the dense peak | the table's TFLOP/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in result["gemms"]:
        table = f"{row['table_tflops']:,.1f}" if row["table_tflops"] else "-"
        cells = (row["model"], row["dtype"], f"{row['tflops']:,.1f}", percent(row["of_peak"]), table)
        print("| " + " | ".join(cells) + " |")
    if not any(row["dtype"] == "fp8" for row in result["gemms"]):
        print(f"\nfloat8 rows left out: no fp8 peak known for {result['device']}")
    print(
        "\n| attention (32 heads of 128, bf16) | forward TFLOP/s | backward TFLOP/s | of the bf16 peak "
        "| the table's forward / backward |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in result["attention"]:
        forward, backward = f"{row['forward_tflops']:,.1f}", f"{row['backward_tflops']:,.1f}"
        cells = (row["call"], forward, backward, percent(row["of_peak"]), row.get("table", "-"))
        print("| " + " | ".join(cells) + " |")


def write(cpu: bool, repeats: int, out: str | None) -> dict:
    """Measure this GPU's whole table and write it (``out``: a folder; default the shipped tables')."""
    from yamlformer.builder.analysis.calibration.table import write_table

    table = measure_table(cpu, repeats, log=lambda message: print(message, file=sys.stderr))
    folder = Path(out) if out else SHIPPED
    header = (
        f"{table.gpu}'s kernel rates, measured by `python benchmarks/perf_kernels.py --write` on "
        f"{table.measured.device}\n({table.measured.date}, torch {table.measured.torch}); "
        "yamlformer.builder.analysis.calibration reads it."
    )
    path = write_table(table, folder / f"{table.gpu}.yaml", header)
    print(f"wrote {path}: {sum(len(r) for r in table.gemm.values())} GEMM rows, "
          f"{sum(len(r) for r in table.attention.values())} attention rows, HBM {table.hbm_gbs:,.0f} GB/s")  # fmt: skip
    gemm = [{"dtype": dtype, **row.model_dump()} for dtype, rows in table.gemm.items() for row in rows]
    attention = [{"backend": name, **row.model_dump()} for name, rows in table.attention.items() for row in rows]
    return {
        "path": str(path),
        "gpu": table.gpu,
        "measured": table.measured.model_dump(),
        "gemm": gemm,
        "attention": attention,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the script's plumbing on the CPU at 1/64 of every size")
    parser.add_argument("--repeats", type=count(1, 100), default=10, help="timed calls per row, 1 to 100 (default 10)")
    parser.add_argument(
        "--write",
        action="store_true",
        help="measure this GPU's whole calibration table and write it (default into builder/analysis/calibration/)",
    )
    parser.add_argument("--out", metavar="DIR", help="with --write: the folder to write <gpu>.yaml into")
    args = parser.parse_args(argv)
    if args.out and not args.write:
        parser.error("--out goes with --write")
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: this measures GPU kernels (--cpu checks the script on the CPU)", file=sys.stderr)
        return 2
    if args.write:
        print(json.dumps(write(args.cpu, args.repeats, args.out)))
        return 0
    result = measure(args.cpu, args.repeats)
    print_tables(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
