"""What the performance model (``yamlformer.builder.analysis.perf``) knows of a GPU beyond its
datasheet: its kernels' measured rates, one table per GPU; and what a collective costs on a link
(torch-free).

**Measured, per GPU** (:class:`Calibration`, read from a table file,
``yamlformer.builder.analysis.calibration.table``): a linear's GEMMs at the rate measured at the
nearest shapes (inverse-distance weighted over the four nearest rows in log2 of tokens, input and
output features; exact on a measured row), held to the bandwidth bound (its operands and results
over the measured HBM bandwidth) below them -- the roll-off of small GEMMs; an attention call at the
rate its backend (``flash``, ``cudnn``, ``triton``) reached at the nearest query and key lengths, of
the same causality; memory-bound work at the measured HBM bandwidth. Each rate is kept as a
fraction of the measured GPU's datasheet figure (``yamlformer.builder.analysis.hardware``), so a table
applies to the GPU it measured as measured.

**Which table** (:func:`calibration_for`): the user's folder (what ``builder plan --calibrate``
writes: ``--calibration-dir``, else ``$BUILDER_CALIBRATION_DIR``, else the user data folder), then
the tables shipped here (``h200.yaml``). A GPU with neither is **not measured**: it gets the
reference table's fractions of the datasheet (the H200's, :func:`reference`) on its own datasheet
-- the stated margin -- and every plan on it says so.

**Counted, not measured**: collectives (:func:`collective_seconds`) at ``collective_efficiency`` of
the link with ``latency`` per hop; torchtitan's per-op selective recomputation policy
(:data:`SELECTIVE_RECOMPUTE` of the matmuls recomputed, :data:`SELECTIVE_SAVED` of the activations
kept); the optimizer's bytes per parameter (:func:`optimizer_bytes_per_parameter`) and gradient
clipping's (:data:`CLIP_BYTES`).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from yamlformer.builder.analysis.calibration.table import load_table
from yamlformer.builder.analysis.hardware import GPU, GPUS, gpu, resolve
from yamlformer.builder.analysis.memory import BYTES

#: fraction of the matmul forward FLOPs selective (per-op) recomputation runs again, and of the
#: layer's saved bytes it keeps (torchtitan's policy: every other matmul's output recomputed)
SELECTIVE_RECOMPUTE = 0.5
SELECTIVE_SAVED = 0.35
#: the tables shipped with the package, and the one whose fractions an unmeasured GPU gets
SHIPPED = Path(__file__).resolve().parent
REFERENCE = "h200"
#: rows averaged when a shape falls between measured ones
NEAREST = 4
ENVIRONMENT = "BUILDER_CALIBRATION_DIR"

Point = tuple[tuple[float, ...], tuple[float, ...]]  # (log2 coordinates, values)


#: HBM bytes per local parameter element of gradient clipping (the recipes' and torchtitan's
#: default): the fp32 gradients read for their norm, then read and written scaled
CLIP_BYTES = 12


def optimizer_bytes_per_parameter(state: float = 8) -> float:
    """HBM bytes an optimizer step moves per local parameter element that keeps ``state`` bytes of
    optimizer state per element (the optimizer's declaration, ``yamlformer.builder.optim``; AdamW's
    two fp32 moments: 8): reads the fp32 weight, gradient and state, writes the weight and state
    (AdamW: 16 read, 12 written, 28). The one place the performance model asks."""
    return 12 + 2 * state


@dataclass(frozen=True)
class Calibration:
    """One GPU's measured kernel rates as fractions of the datasheet of the GPU that measured
    them, where they came from (``source``), and whether they were measured on the GPU they are
    applied to (``measured``)."""

    name: str = REFERENCE
    source: str = ""
    measured: bool = True
    #: dtype ("bf16", "fp8") -> ((log2 tokens, log2 k, log2 n), (fraction of that dtype's dense peak,))
    gemm: Mapping[str, tuple[Point, ...]] = field(default_factory=dict, compare=False, repr=False)
    #: backend -> ((log2 queries, log2 keys, causal), (forward, backward fraction of the bf16 peak))
    attention: Mapping[str, tuple[Point, ...]] = field(default_factory=dict, compare=False, repr=False)
    hbm_fraction: float = 0.8  # of the datasheet HBM bandwidth
    collective_efficiency: float = 0.70  # of a link's datasheet bandwidth (NCCL bus bandwidth)
    latency: float = 10e-6  # seconds per collective hop

    def linear_seconds(self, dtype: str, tokens: float, k: int, n: int, gpu) -> float:
        """Seconds of one linear's forward, input-gradient and weight-gradient GEMMs over
        ``tokens`` rows from ``k`` to ``n`` features on ``gpu``: their ``6 tokens k n`` FLOPs at the
        measured rate (``fp8``: float8 operands at the fp8 rate; ``fp16``, ``fp32``: at the bf16
        rows' fractions of their own peak), or their bytes over the HBM bandwidth if that is longer
        (operands and results of the three, ``(2 x operand + result bytes) (tokens k + k n + tokens n)``)."""
        if tokens <= 0 or k <= 0 or n <= 0:
            return 0.0
        rows = self.gemm.get("fp8" if dtype == "fp8" else "bf16") or self.gemm["bf16"]
        (fraction,) = interpolate(rows, (math.log2(tokens), math.log2(k), math.log2(n)))
        compute = 6 * tokens * k * n / (fraction * gpu.peak_flops(dtype))
        operand, result = (1, 2) if dtype == "fp8" else (BYTES[dtype], BYTES[dtype])
        moved = (2 * operand + result) * (tokens * k + k * n + tokens * n)
        return max(compute, moved / self.hbm(gpu))

    def attention_rates(self, backend: str, queries: float, keys: float, causal: bool, gpu) -> tuple[float, float]:
        """``(forward, backward)`` FLOP/s of one attention call of ``backend`` over ``queries`` and
        ``keys`` on ``gpu`` (the backward's FLOPs counted as twice the forward's): the rows of the
        same causality nearest in length, else any. A backend the table has no rows of is rated
        as its first (:meth:`backend_for`)."""
        rows = self.attention[self.backend_for(backend)]
        same = tuple(p for p in rows if p[0][2] == float(causal)) or rows
        forward, backward = interpolate(same, (math.log2(max(queries, 1)), math.log2(max(keys, 1)), float(causal)))
        peak = gpu.peak_flops("bf16")
        return forward * peak, backward * peak

    def backend_for(self, backend: str) -> str:
        """``backend`` if the table rates it, else the table's first (flash before cudnn before triton)."""
        return backend if backend in self.attention else next(iter(self.attention))

    def hbm(self, gpu) -> float:
        """Bytes/s memory-bound work reaches on ``gpu``."""
        return self.hbm_fraction * gpu.hbm_bandwidth

    def describe(self) -> str:
        """One line: where the rates come from, and the counted constants."""
        return (
            f"kernel rates {self.source}; collectives at {self.collective_efficiency:.0%} of link bandwidth, "
            f"{self.latency * 1e6:g} us per hop; selective recomputation reruns {SELECTIVE_RECOMPUTE:.0%} of the "
            f"matmuls and keeps {SELECTIVE_SAVED:.0%} of the activations"
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "measured": self.measured,
            "hbm_fraction": self.hbm_fraction,
            "collective_efficiency": self.collective_efficiency,
            "latency": self.latency,
            "backends": list(self.attention),
            "gemm_dtypes": list(self.gemm),
        }


def interpolate(points: tuple[Point, ...], at: tuple[float, ...]) -> tuple[float, ...]:
    """The values at ``at``: a row's own where ``at`` is one, else the mean of the
    :data:`NEAREST` nearest rows' weighted by the inverse of their squared distance."""
    ranked = sorted((sum((a - b) ** 2 for a, b in zip(coords, at)), values) for coords, values in points)
    if ranked[0][0] < 1e-12:
        return ranked[0][1]
    near = ranked[:NEAREST]
    weights = [1 / d for d, _ in near]
    total = sum(weights)
    return tuple(sum(w * values[i] for w, (_, values) in zip(weights, near)) / total for i in range(len(near[0][1])))


def from_table(table, gpu, where: str) -> Calibration:
    """A table (``yamlformer.builder.analysis.calibration.table.CalibrationTable``) as fractions of
    ``gpu``'s datasheet (the GPU it measured)."""
    gemm = {
        dtype: tuple(
            (
                (math.log2(r.tokens), math.log2(r.k), math.log2(r.n)),
                (r.tflops * 1e12 / gpu.peak_flops(dtype),),
            )
            for r in rows
        )
        for dtype, rows in table.gemm.items()
        if dtype in gpu.peak
    }
    peak = gpu.peak_flops("bf16")
    attention = {
        backend: tuple(
            (
                (math.log2(r.queries), math.log2(r.keys), float(r.causal)),
                (r.forward_tflops * 1e12 / peak, r.backward_tflops * 1e12 / peak),
            )
            for r in rows
        )
        for backend, rows in table.attention.items()
    }
    run = table.measured
    source = f"measured on {run.device}, {run.date}, torch {run.torch} ({where})"
    return Calibration(
        name=table.gpu,
        source=source,
        measured=True,
        gemm=gemm,
        attention=attention,
        hbm_fraction=table.hbm_gbs * 1e9 / gpu.hbm_bandwidth,
    )


def user_folder(directory: str | os.PathLike | None = None) -> Path:
    """Where ``builder plan --calibrate`` writes and the planner looks first: ``directory``, else
    ``$BUILDER_CALIBRATION_DIR``, else the user data folder's ``calibration``."""
    if directory is not None:
        return Path(directory)
    if os.environ.get(ENVIRONMENT):
        return Path(os.environ[ENVIRONMENT])
    # local: platformdirs loads only where no calibration folder is set
    import platformdirs

    return Path(platformdirs.user_data_dir("builder", appauthor=False)) / "calibration"


def table_path(key: str, directory: str | os.PathLike | None = None) -> Path | None:
    """The table of ``key`` (``h200``, ``cpu``): the user's folder's, else the shipped one, else None
    (None too for a key that is no plain file name)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", key):
        return None
    for folder in (user_folder(directory), SHIPPED):
        path = folder / f"{key}.yaml"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=32)
def _read(path: Path, mtime: float):

    return load_table(path)


def read_table(path: Path):
    """The validated table at ``path`` (read once while the file is unchanged)."""
    return _read(path, path.stat().st_mtime)


def reference() -> Calibration:
    """The shipped :data:`REFERENCE` table (the H200's), whatever the user's folder holds."""

    path = SHIPPED / f"{REFERENCE}.yaml"
    return from_table(read_table(path), gpu(REFERENCE), f"builder/analysis/calibration/{path.name}")


def calibration_for(key: str, gpu, directory: str | os.PathLike | None = None) -> Calibration:
    """The calibration of the GPU the hardware table (or a table's own datasheet) calls ``key``,
    ``gpu`` its datasheet row: its measured table (:func:`table_path`), else the reference's
    fractions on ``gpu``'s datasheet, ``measured`` False and the ``source`` saying so. A table whose
    ``gpu`` is not ``key`` is refused (``ValueError``)."""
    path = table_path(key, directory)
    if path is not None:
        table = read_table(path)
        if table.gpu != key:
            raise ValueError(f"{path}: gpu: {table.gpu!r}, but the file is {key!r}'s (its name)")
        where = f"builder/analysis/calibration/{path.name}" if path.parent == SHIPPED else str(path)
        return from_table(table, gpu, where)
    ref = reference()
    source = (
        f"not measured on {gpu.name}: its datasheet x the fractions of the datasheet the reference GPU reached "
        f"({ref.source}); `builder plan --calibrate` on one measures it"
    )
    return replace(ref, name=key, measured=False, source=source)


def datasheet_gpu(datasheet):
    """The hardware row of a device a table's ``datasheet`` describes
    (``yamlformer.builder.analysis.calibration.table.Datasheet``)."""

    peak = {dtype: value * 1e12 for dtype, value in datasheet.peak_tflops.items()}
    peak.setdefault("fp16", peak["bf16"])
    return GPU(
        datasheet.name,
        peak,
        int(datasheet.memory_gb * 1e9),
        datasheet.hbm_gbs * 1e9,
        datasheet.intra_node_gbs * 1e9,
        datasheet.inter_node_gbs * 1e9,
    )


def lookup(name: str, directory: str | os.PathLike | None = None):
    """``(key, row, calibration)`` of ``--gpu NAME``: its key, its datasheet row (the hardware
    table's, else the one a calibration table of it carries) and :func:`calibration_for` it.
    ``ValueError`` names a device neither knows."""

    key = resolve(name)
    if key in GPUS:
        row = GPUS[key]
    else:
        path = table_path(key, directory)
        table = read_table(path) if path is not None else None
        if table is None or table.datasheet is None:
            gpu(name)  # the hardware table's refusal, naming what it knows
        row = datasheet_gpu(table.datasheet)
    return key, row, calibration_for(key, row, directory)


def cluster_calibration(cluster) -> Calibration:
    """A ``yamlformer.builder.analysis.hardware.Cluster``'s calibration: its own, else
    :func:`calibration_for` its GPU (by its name)."""

    return cluster.calibration or calibration_for(resolve(cluster.gpu), cluster.hardware)


def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float, cal: Calibration) -> float:
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


def __getattr__(name: str):
    if name == "CALIBRATION":  # the reference table, read on first use
        return reference()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
