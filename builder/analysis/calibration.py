"""The performance model's constants (``yamlformer.builder.analysis.perf``): one set for every GPU and every
run, printed with each prediction, and what a collective costs on a link (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: fraction of the matmul forward FLOPs selective (per-op) recomputation runs again, and of the
#: layer's saved bytes it keeps
SELECTIVE_RECOMPUTE = 0.5
SELECTIVE_SAVED = 0.35
#: HBM passes over each saved byte: written in forward, read in backward, its gradient written
ELEMENTWISE_PASSES = 6
#: fraction of those passes torch.compile fuses away
COMPILE_FUSION = 0.7
#: bytes AdamW reads and writes per local parameter element (fp32 weight, gradient, two states
#: read; weight and states written)
OPTIMIZER_BYTES = 28
#: fraction of the tensor-parallel collectives async TP hides behind its matmuls
ASYNC_TP_OVERLAP = 0.5
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Calibration:
    """The model's physically meaningful constants, one set for every run."""

    matmul_efficiency: float = 0.45  # achievable fraction of the dense bf16 peak in a model's GEMMs
    attention_efficiency: float = 0.35  # a flash-attention kernel's, forward and backward
    float8_efficiency: float = 0.30  # of the fp8 peak: float8 projections with their scaling casts
    collective_efficiency: float = 0.70  # of a link's datasheet bandwidth (NCCL bus bandwidth)
    latency: float = 10e-6  # seconds per collective hop

    def describe(self) -> str:
        return (
            f"matmuls at {self.matmul_efficiency:.0%} of peak (float8 at {self.float8_efficiency:.0%} of the fp8 "
            f"peak), attention kernels at {self.attention_efficiency:.0%}, "
            f"collectives at {self.collective_efficiency:.0%} of link bandwidth, {self.latency * 1e6:g} us per hop; "
            f"selective recomputation reruns {SELECTIVE_RECOMPUTE:.0%} of the matmuls and keeps {SELECTIVE_SAVED:.0%} "
            f"of the activations; {ELEMENTWISE_PASSES} HBM passes per saved byte (compile fuses "
            f"{COMPILE_FUSION:.0%}); async TP hides {ASYNC_TP_OVERLAP:.0%} of TP's collectives"
        )


CALIBRATION = Calibration()


def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float, cal: Calibration = CALIBRATION) -> float:
    """Seconds for one collective of ``nbytes`` (the whole tensor: all-gather's output,
    reduce-scatter's input, all-reduce's buffer, all-to-all's data per rank, a send's message)
    over ``group`` ranks at ``bandwidth`` bytes/s per rank: a ring moves ``(n-1)/n`` of it per
    rank (twice for all-reduce) in ``n-1`` hops; an all-reduce may instead take a double binary
    tree, ``2 log2 n`` hops moving it twice, whichever is faster."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha, n = bandwidth * cal.collective_efficiency, cal.latency, group
    share = (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return share + (n - 1) * alpha
    if kind == "all_reduce":
        ring = 2 * share + 2 * (n - 1) * alpha
        tree = 2 * nbytes / bw + 2 * math.log2(n) * alpha
        return min(ring, tree)
    if kind == "send":
        return nbytes / bw + alpha
    raise ValueError(f"unknown collective {kind!r}")
