"""Measure this machine's GPU into a calibration table (``builder plan --calibrate``,
``benchmarks/perf_kernels.py --write``): what ``yamlformer.builder.analysis.calibration`` reads.

Three sweeps, each timed as the median of ``repeats`` calls after two untimed ones (CUDA events):

* **GEMMs**, bf16 and (where the GPU has an fp8 peak) float8 (``torch._scaled_mm``, e4m3 with
  per-tensor scales into bf16, as torchao's dynamic scaling calls it): every linear of a grid
  (:data:`GRID_TOKENS` x :data:`GRID_FEATURES` squared, the small ones the roll-off) and of the
  published runs' layers (:data:`LAYERS`), each as its forward ``x W^T``, input gradient and
  weight gradient;
* **attention** by backend: SDPA's flash and cuDNN backends on causal sequences of
  :data:`ATTENTION_LENGTHS` and ring attention's half-block steps (:data:`RING_STEPS`), this
  project's Triton kernel on :data:`TRITON_LENGTHS` (each new length autotunes, ~20 s);
  32 heads of 128 in bf16, forward and backward timed apart, FLOPs over the visible pairs;
* **HBM**: a streaming elementwise kernel (``torch.add`` into a third tensor of 2^28 bf16
  elements), its bytes read and written over its time.

On an H200 the whole measurement takes about a minute (the Triton kernel's autotuning most of it).
``cpu=True`` runs a few of the same on the CPU at 1/64 of every size, three timed calls a row
(the machinery, in the test suite: the grid's corners, SDPA's CPU flash kernel at two lengths and
a ring step), writing a table for ``cpu`` with its own datasheet (its best GEMM rate as its peak).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from yamlformer.builder.analysis.calibration.table import CalibrationTable
from yamlformer.builder.analysis.hardware import GPUS, resolve
from yamlformer.builder.analysis.mfu import match_device
from yamlformer.kernels import Mask, attention

#: one rank's projections of one layer of each published run: (tokens, [(k, n), ...])
LAYERS = {
    "llama3-8b, FSDP (table 1)": (2 * 8192, [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096),
                                              (4096, 14336), (4096, 14336), (14336, 4096)]),
    "llama3-70b, TP 8 (table 4)": (16 * 8192, [(8192, 1024), (8192, 128), (8192, 128), (1024, 8192),
                                                (8192, 3584), (8192, 3584), (3584, 8192)]),
    "llama3-405b, TP 8 (table 5)": (4 * 8192, [(16384, 2048), (16384, 128), (16384, 128), (2048, 16384),
                                                (16384, 6656), (16384, 6656), (6656, 16384)]),
}  # fmt: skip
GRID_TOKENS = (1024, 4096, 16384, 65536)
GRID_FEATURES = (256, 1024, 2048, 4096, 16384)
#: causal whole sequences (flash, cuDNN), and ring attention's steps at 32,768 a rank: queries x half
#: the keys, half the queries x all keys (non-causal)
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
RING_STEPS = ((32768, 16384), (16384, 32768))
TRITON_LENGTHS = (2048, 8192)
HEADS, HEAD_DIM = 32, 128
#: a call's batch: enough sequences for this many query tokens
ATTENTION_TOKENS = 32768
STREAM_ELEMENTS = 1 << 28
CPU_SCALE = 64
CPU_HEADS = 2
CPU_REPEATS = 3


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


def linear_seconds(tokens: int, k: int, n: int, fp8: bool, device: torch.device, repeats: int) -> float:
    """A linear's forward ``x W^T``, input gradient ``dY W`` and weight gradient ``dY^T X``."""
    return sum(gemm_seconds(*shape, fp8, device, repeats) for shape in ((tokens, k, n), (tokens, n, k), (n, tokens, k)))


def _aligned(size: int, scale: int) -> int:
    return max(16, size // scale // 16 * 16)


def linears(scale: int) -> list[tuple[int, int, int]]:
    """``(tokens, k, n)`` of every linear the GEMM sweep times (the grid, then the published
    layers'), each size divided by ``scale`` (multiples of 16 at least 16: float8's alignment);
    on the CPU (``scale`` > 1) the grid's corners only."""
    tokens, features = (GRID_TOKENS, GRID_FEATURES) if scale == 1 else _corners()
    shapes = [(t, k, n) for t in tokens for k in features for n in features]
    if scale == 1:
        shapes += [(t, k, n) for t, projections in LAYERS.values() for k, n in projections]
    return list(dict.fromkeys((max(16, t // scale), _aligned(k, scale), _aligned(n, scale)) for t, k, n in shapes))


def _corners() -> tuple[tuple[int, ...], tuple[int, ...]]:
    # at 1/64: 64 and 1,024 tokens, 16 and 256 features
    return (GRID_TOKENS[1], GRID_TOKENS[-1]), (GRID_FEATURES[1], GRID_FEATURES[-1])


def sdpa(backend: str):
    """SDPA restricted to ``backend`` (``flash``, ``cudnn``) as a ``(q, k, v, causal)`` call."""

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def triton_attention(q, k, v, causal):

    return attention(q, k, v, Mask(causal=causal), backend="triton")


def attention_rates(call, queries: int, keys: int, causal: bool, device: torch.device, repeats: int):
    """``(forward, backward)`` FLOP/s of ``call`` over ``queries`` and ``keys`` (the backward's FLOPs
    twice the forward's over the visible pairs); None where the backend cannot run the shape."""
    cuda = device.type == "cuda"
    batch, heads = (max(1, ATTENTION_TOKENS // max(queries, 1)), HEADS) if cuda else (1, CPU_HEADS)
    shape = (batch, heads, queries, HEAD_DIM)
    q = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn((batch, heads, keys, HEAD_DIM), device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    offset = keys - queries  # the queries are the last positions
    pairs = sum(min(keys, offset + i + 1) for i in range(queries)) if causal else queries * keys
    flops = 4 * batch * heads * HEAD_DIM * pairs

    def forward():
        with torch.no_grad():
            return call(q, k, v, causal)

    def both():
        torch.autograd.grad(call(q, k, v, causal), (q, k, v), grad)

    try:
        fwd = timed(forward, device, repeats)
        bwd = max(timed(both, device, repeats) - fwd, 1e-9)
    except RuntimeError:  # a backend that does not take this shape on this device
        return None
    return flops / fwd, 2 * flops / bwd


def stream_bandwidth(device: torch.device, repeats: int, elements: int) -> float:
    """Bytes/s of ``torch.add`` of two bf16 tensors into a third (read two, write one)."""
    a, b = (torch.randn(elements, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    return 3 * elements * 2 / timed(lambda: torch.add(a, b, out=out), device, repeats)


def device_key(name: str) -> str | None:
    """The hardware table's key for a CUDA device's name (``NVIDIA H200`` -> ``h200``), None for a
    device the table does not know."""

    matched = match_device(name)
    key = resolve(matched) if matched else None
    return key if key in GPUS else None


def slug(name: str) -> str:
    """A file name for a device the hardware table does not know (``Some GPU 48GB`` -> ``some-gpu-48gb``)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "device"


def measure(cpu: bool = False, repeats: int = 10, log=None) -> CalibrationTable:
    """This machine's GPU (``cpu``: the CPU at 1/64 of every size) measured into a table; ``log``
    (a callable) hears each sweep as it finishes."""
    say = log or (lambda message: None)
    repeats = min(repeats, CPU_REPEATS) if cpu else repeats
    device = torch.device("cpu" if cpu else "cuda")
    name = "cpu" if cpu else torch.cuda.get_device_name()
    key = "cpu" if cpu else (device_key(name) or slug(name))

    peaks = GPUS[key].peak if key in GPUS else {}
    fp8 = cpu or "fp8" in peaks
    scale = CPU_SCALE if cpu else 1
    torch.manual_seed(0)
    began = time.perf_counter()
    gemm: dict[str, list[dict]] = {}
    for dtype in ("bf16", "fp8") if fp8 else ("bf16",):
        rows = []
        shapes = linears(scale)
        for t, k, n in shapes[: len(shapes) // 2] if cpu and dtype == "fp8" else shapes:  # the CPU's: the plumbing
            seconds = linear_seconds(t, k, n, dtype == "fp8", device, repeats)
            rows.append({"tokens": t, "k": k, "n": n, "tflops": 6 * t * k * n / seconds / 1e12})
        gemm[dtype] = rows
        say(f"GEMMs, {dtype}: {len(gemm[dtype])} linears ({time.perf_counter() - began:.0f} s)")
    calls = {backend: sdpa(backend) for backend in (("flash",) if cpu else ("flash", "cudnn"))}
    if not cpu:
        calls["triton"] = triton_attention
    attention: dict[str, list[dict]] = {}
    for backend, call in calls.items():
        lengths = TRITON_LENGTHS if backend == "triton" or cpu else ATTENTION_LENGTHS
        steps = () if backend == "triton" else RING_STEPS[:1] if cpu else RING_STEPS
        shapes = [(s, s, True) for s in lengths] + [(q, k, False) for q, k in steps]
        rows = []
        for q, k, causal in shapes:
            q, k = max(16, q // scale), max(16, k // scale)
            rates = attention_rates(call, q, k, causal, device, max(3, repeats // 2))  # long calls: fewer
            if rates is not None:
                forward, backward = rates[0] / 1e12, rates[1] / 1e12
                rows.append(
                    {"queries": q, "keys": k, "causal": causal, "forward_tflops": forward, "backward_tflops": backward}
                )
        if rows:
            attention[backend] = rows
        say(f"attention, {backend}: {len(rows)} calls ({time.perf_counter() - began:.0f} s)")
    hbm = stream_bandwidth(device, repeats, STREAM_ELEMENTS // scale**2)
    say(f"HBM: {hbm / 1e9:,.0f} GB/s ({time.perf_counter() - began:.0f} s)")
    data = {
        "gpu": key,
        "measured": {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "device": name,
            "command": "builder plan --calibrate" + (" --cpu" if cpu else ""),
            "note": f"{time.perf_counter() - began:.0f} s, {repeats} timed calls a row"
            + (f"; every size / {scale}: the machinery, not a measurement of a GPU" if cpu else ""),
        },
        "hbm_gbs": hbm / 1e9,
        "gemm": gemm,
        "attention": attention,
    }
    if key not in GPUS:
        data["datasheet"] = _own_datasheet(name, gemm, hbm, cpu)
    return CalibrationTable.model_validate(data)


def _own_datasheet(name: str, gemm: dict, hbm: float, cpu: bool) -> dict:
    """What the planner plans a device the hardware table does not know with: its best measured
    GEMM rates as its peaks, its memory, the measured bandwidth for its memory and its links."""
    if cpu:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        memory = torch.cuda.get_device_properties(0).total_memory
    peaks = {dtype: max(row["tflops"] for row in rows) for dtype, rows in gemm.items()}
    return {
        "name": name,
        "peak_tflops": peaks,
        "memory_gb": memory / 1e9,
        "hbm_gbs": hbm / 1e9,
        "intra_node_gbs": hbm / 1e9,
        "inter_node_gbs": hbm / 1e9,
    }
