"""The performance model's kernel efficiencies, measured on one GPU at the published runs' shapes.

``yamlformer.builder.analysis.perf`` runs every matmul at one fraction of the peak (``matmul_efficiency``,
float8 ``float8_efficiency``) and every attention kernel at another (``attention_efficiency``);
``benchmarks/plan_vs_published.py`` shows where that misses: the float8 runs with tensor parallel 8
(70B, 405B) are predicted 14-24% too slow, and ring attention at 128K-256K tokens far too fast.
This script measures, on the GPU it runs on, what those constants stand for, at the shapes one
rank of each published run computes:

* **GEMMs**: every projection of one layer (forward ``x W^T``, the input gradient and the weight
  gradient), bf16 and float8 (``torch._scaled_mm``, per-tensor scales, as torchao's dynamic
  scaling calls it), for Llama 3.1 8B under FSDP (table 1: 2 x 8192 tokens a rank), 70B and 405B
  under TP 8 (tables 4 and 5: 16 x 8192 and 4 x 8192 tokens, each projection a TP rank's slice).
  Reported per model as the FLOP-weighted fraction of the dense peak: the number
  ``matmul_efficiency`` / ``float8_efficiency`` should be if GEMM shape were all that differs
  (the GEMMs alone: the model's float8 constant also covers torchao's scaling casts).
* **Attention** (SDPA's flash backend, bf16, forward and backward): the ring steps of table 2 (8B
  with its keys and values repeated to 32 heads of 128, 32,768 tokens a rank: the causal first step,
  and the two half-work steps, queries against half the keys and half the queries against all),
  and a whole causal sequence of 8,192 tokens; efficiency counted as the model counts FLOPs (the
  visible pairs, backward twice the forward).

    python benchmarks/perf_kernels.py            # on a GPU (~10^15 FLOPs: estimated under a minute, not yet run)
    python benchmarks/perf_kernels.py --cpu      # the script's plumbing at 1/64 of every size

The output is Markdown (for benchmarks/RESULTS.md); the last line is JSON. Without CUDA and
without ``--cpu`` it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ != "__main__":
    sys.path.append(os.path.join(ROOT, "benchmarks"))  # imported (gpu_check, tests): attention.py's SDPA backends

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from yamlformer.builder.analysis.calibration import CALIBRATION  # noqa: E402
from yamlformer.builder.analysis.hardware import gpu  # noqa: E402
from yamlformer.builder.analysis.mfu import match_device  # noqa: E402
from yamlformer.builder.cli.arguments import count  # noqa: E402

#: one rank's projections of one layer: (name, tokens, in features, out features)
LAYERS = {
    "llama3-8b, FSDP (table 1)": (2 * 8192, [("wq", 4096, 4096), ("wk", 4096, 1024), ("wv", 4096, 1024),
                                              ("wo", 4096, 4096), ("w1", 4096, 14336), ("w3", 4096, 14336),
                                              ("w2", 14336, 4096)]),
    "llama3-70b, TP 8 (table 4)": (16 * 8192, [("wq", 8192, 1024), ("wk", 8192, 128), ("wv", 8192, 128),
                                                ("wo", 1024, 8192), ("w1", 8192, 3584), ("w3", 8192, 3584),
                                                ("w2", 3584, 8192)]),
    "llama3-405b, TP 8 (table 5)": (4 * 8192, [("wq", 16384, 2048), ("wk", 16384, 128), ("wv", 16384, 128),
                                                ("wo", 2048, 16384), ("w1", 16384, 6656), ("w3", 16384, 6656),
                                                ("w2", 6656, 16384)]),
}  # fmt: skip
#: attention calls: (label, query tokens, key tokens, causal); 32 heads of 128 (8B's, repeated)
ATTENTION = [
    ("whole sequence 8,192, causal (table 1)", 8192, 8192, True),
    ("32,768 causal: table 2's CP 1, and ring step 0 at CP 2-8 (32,768 a rank)", 32768, 32768, True),
    ("ring step, queries x half the keys (table 2)", 32768, 16384, False),
    ("ring step, half the queries x all keys (table 2)", 16384, 32768, False),
]
HEADS, HEAD_DIM = 32, 128


def timed(fn, device: torch.device, repeats: int) -> float:
    """The median seconds of ``fn()`` over ``repeats`` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def gemm_seconds(m: int, k: int, n: int, fp8: bool, device: torch.device, repeats: int) -> float:
    """One ``(m, k) @ (k, n)`` product: bf16, or float8 e4m3 with per-tensor scales into bf16."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)  # row-major (n, k): b.t() is column-major
    if not fp8:
        return timed(lambda: a @ b.t(), device, repeats)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    return timed(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), device, repeats)


def gemm_rows(peaks: dict, device: torch.device, scale: int, repeats: int, fp8: bool) -> list[dict]:
    rows = []
    for model, (tokens, projections) in LAYERS.items():
        for dtype in ("bf16", "fp8") if fp8 else ("bf16",):
            flops = seconds = 0.0
            for _, k, n in projections:
                m, k, n = tokens // scale, max(16, k // scale // 16 * 16), max(16, n // scale // 16 * 16)
                # forward x W^T, the input gradient dY W, the weight gradient dY^T X
                for shape in ((m, k, n), (m, n, k), (n, m, k)):
                    flops += 2 * shape[0] * shape[1] * shape[2]
                    seconds += gemm_seconds(*shape, dtype == "fp8", device, repeats)
            model_efficiency = CALIBRATION.float8_efficiency if dtype == "fp8" else CALIBRATION.matmul_efficiency
            rows.append(
                {
                    "model": model,
                    "dtype": dtype,
                    "tflops": flops / seconds / 1e12,
                    "of_peak": flops / seconds / peaks[dtype] if peaks.get(dtype) else None,
                    "model_constant": model_efficiency,
                }
            )
    return rows


def attention_rows(peak: float | None, device: torch.device, scale: int, repeats: int) -> list[dict]:
    if device.type == "cuda":  # the flash backend alone, as benchmarks/attention.py restricts it
        from attention import sdpa_backend

        sdpa = sdpa_backend("flash")
    else:
        sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    rows = []
    for label, q_len, k_len, causal in ATTENTION:
        q_len, k_len = q_len // scale, k_len // scale
        shape = (1, HEADS, q_len, HEAD_DIM)
        q = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn((1, HEADS, k_len, HEAD_DIM), device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
        pairs = q_len * (q_len + 1) // 2 if causal else q_len * k_len
        forward_flops = 2 * 2 * pairs * HEADS * HEAD_DIM  # scores and mix over the visible pairs

        def forward(q=q, k=k, v=v, causal=causal):
            with torch.no_grad():
                return sdpa(q, k, v, causal)

        def both(q=q, k=k, v=v, causal=causal, grad=grad):
            out = sdpa(q, k, v, causal)
            torch.autograd.grad(out, (q, k, v), grad)

        fwd = timed(forward, device, repeats)
        bwd = max(timed(both, device, repeats) - fwd, 1e-9)
        row = {
            "call": label,
            "forward_tflops": forward_flops / fwd / 1e12,
            "backward_tflops": 2 * forward_flops / bwd / 1e12,
        }
        row["of_peak"] = 3 * forward_flops / (fwd + bwd) / peak if peak else None
        row["model_constant"] = CALIBRATION.attention_efficiency
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
    fp8 = cpu or "fp8" in peaks  # torch's CPU _scaled_mm runs the float8 rows' plumbing
    scale = 64 if cpu else 1
    torch.manual_seed(0)
    return {
        "device": name,
        "scale": scale,
        "peaks": {k: v for k, v in peaks.items() if k in ("bf16", "fp8")},
        "gemms": gemm_rows(peaks, device, scale, repeats, fp8),
        "attention": attention_rows(peaks.get("bf16"), device, scale, repeats),
    }


def print_tables(result: dict) -> None:
    peaks = ", ".join(f"{k} {v / 1e12:,.1f}" for k, v in result["peaks"].items()) or "unknown"
    torch_version = torch.__version__
    print(
        f"Device: {result['device']} (dense peak TFLOP/s, builder/analysis/hardware.py: {peaks}); torch {torch_version}"
    )
    if result["scale"] > 1:
        print(f"(every size / {result['scale']}: the script's plumbing, not a measurement of the model's GPUs)")
    print("\n| one layer's projections | dtype | TFLOP/s | of the dense peak | the model's constant |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in result["gemms"]:
        cells = (
            row["model"],
            row["dtype"],
            f"{row['tflops']:,.1f}",
            percent(row["of_peak"]),
            percent(row["model_constant"]),
        )
        print("| " + " | ".join(cells) + " |")
    if not any(row["dtype"] == "fp8" for row in result["gemms"]):
        print(f"\nfloat8 rows left out: no fp8 peak known for {result['device']}")
    print(
        "\n| attention (32 heads of 128, bf16) | forward TFLOP/s | backward TFLOP/s | of the bf16 peak | the model's |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in result["attention"]:
        forward, backward = f"{row['forward_tflops']:,.1f}", f"{row['backward_tflops']:,.1f}"
        cells = (row["call"], forward, backward, percent(row["of_peak"]), percent(row["model_constant"]))
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the script's plumbing on the CPU at 1/64 of every size")
    parser.add_argument("--repeats", type=count(1, 100), default=10, help="timed calls per row, 1 to 100 (default 10)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: this measures GPU kernels (--cpu checks the script on the CPU)", file=sys.stderr)
        return 2
    result = measure(args.cpu, args.repeats)
    print_tables(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
