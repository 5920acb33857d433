"""The GPUs the performance model (``yamlformer.builder.analysis.perf``) knows: one row of figures each (torch-free).

Every figure is the vendor's datasheet figure for one GPU, dense (no 2:4 sparsity, i.e. half the
headline "with sparsity" tensor-core numbers), in SI units (FLOP/s, bytes, bytes/s); links are
per GPU and per direction (half the "bidirectional" NVLink totals):

* A100 40 GB / 80 GB SXM4 — NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/
  Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312
  TFLOPS, HBM2 1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB), NVLink 600 GB/s; no FP8. Network:
  one 200 Gb/s HDR InfiniBand adapter per GPU, as the DGX A100 (DGX A100 datasheet).
* H100 SXM5 / PCIe, H800 SXM5 — NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/
  en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): SXM BF16 1,979 / FP8 3,958 TFLOPS with
  sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; PCIe BF16 1,513 / FP8 3,026 TFLOPS with
  sparsity, 80 GB HBM2e at 2 TB/s, PCIe Gen5 128 GB/s (NVLink bridges join pairs only). H800: the
  H100 SXM with NVLink cut to 400 GB/s (DeepSeek-V3 technical report, arXiv:2412.19437, section
  3.2.2: "NVLink ... 160 GB/s" achieved and "IB ... 50 GB/s", one 400 Gb/s NIC per GPU).
  Network: one 400 Gb/s NDR adapter per GPU (DGX H100 datasheet).
* H200 SXM — NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): H100 SXM compute, 141 GB
  HBM3e at 4.8 TB/s, NVLink 900 GB/s.
* B200 — NVIDIA HGX B200 / DGX B200 datasheet: per GPU 4.5 PFLOPS FP16/BF16 and 9 PFLOPS FP8
  with sparsity, 180 GB HBM3e at 8 TB/s, fifth-generation NVLink 1.8 TB/s, one 400 Gb/s
  ConnectX-7 per GPU.
* MI300X — AMD Instinct MI300X data sheet (amd.com/.../instinct-mi300x-data-sheet.pdf): BF16
  1,307.4 TFLOPS, FP8 2,614.9 TFLOPS (dense), 192 GB HBM3 at 5.3 TB/s, 896 GB/s aggregate
  peer-to-peer Infinity Fabric (seven links); one 400 Gb/s NIC per GPU in the 8-GPU platform.

Any figure can be overridden (``builder plan --peak-tflops --hbm-bandwidth --intra-node-bandwidth
--inter-node-bandwidth --gpu-memory``): :func:`gpu` takes the overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

T = 1e12
G = 1e9
GB = 10**9
#: one 400 Gb/s network adapter per GPU, in bytes/s
NDR = 400e9 / 8
HDR = 200e9 / 8


@dataclass(frozen=True)
class GPU:
    """One GPU's datasheet figures: ``peak`` dense FLOP/s by dtype (``bf16``, ``fp16``, ``fp8``;
    ``fp32`` the tensor-core TF32 rate), ``memory`` bytes of HBM at ``hbm_bandwidth`` bytes/s,
    ``intra_node`` and ``inter_node`` bytes/s per GPU per direction (NVLink or its kin inside a
    node, the network between nodes), ``per_node`` GPUs in one machine."""

    name: str
    peak: dict
    memory: int
    hbm_bandwidth: float
    intra_node: float
    inter_node: float
    per_node: int = 8

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak:
            raise ValueError(f"{self.name} has no {dtype} tensor-core peak; one of {', '.join(self.peak)}")
        return self.peak[dtype]


def _peaks(bf16: float, fp8: float | None, tf32: float) -> dict:
    out = {"bf16": bf16 * T, "fp16": bf16 * T, "fp32": tf32 * T}
    if fp8 is not None:
        out["fp8"] = fp8 * T
    return out


#: the hardware table, by the names ``--gpu`` takes
GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("A100 40GB SXM", _peaks(312, None, 156), 40 * GB, 1555 * G, 300 * G, HDR),
    "a100-80gb": GPU("A100 80GB SXM", _peaks(312, None, 156), 80 * GB, 2039 * G, 300 * G, HDR),
    "h100": GPU("H100 SXM", _peaks(989.5, 1979, 494.5), 80 * GB, 3350 * G, 450 * G, NDR),
    "h100-pcie": GPU("H100 PCIe", _peaks(756.5, 1513, 378), 80 * GB, 2000 * G, 64 * G, NDR),
    "h800": GPU("H800 SXM", _peaks(989.5, 1979, 494.5), 80 * GB, 3350 * G, 200 * G, NDR),
    "h200": GPU("H200 SXM", _peaks(989.5, 1979, 494.5), 141 * GB, 4800 * G, 450 * G, NDR),
    "b200": GPU("B200", _peaks(2250, 4500, 1125), 180 * GB, 8000 * G, 900 * G, NDR),
    "mi300x": GPU("MI300X", _peaks(1307.4, 2614.9, 653.7), 192 * GB, 5300 * G, 448 * G, NDR),
}
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}


def resolve(name: str) -> str:
    """The key ``name`` stands for (``H100 SXM`` -> ``h100``), known to the table or not."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    return ALIASES.get(key, key)


def gpu(name: str, row: GPU | None = None, **overrides) -> GPU:
    """The table's row for ``name`` (``h100``, ``H100 SXM``, ``mi300x``), or ``row`` (a device the
    table does not know: a calibration table's own datasheet), with any figure replaced:
    ``memory``, ``hbm_bandwidth``, ``intra_node``, ``inter_node``, ``per_node`` or ``peak`` (FLOP/s
    in every dtype it lists, scaled together). ``ValueError`` names an unknown GPU."""
    key = resolve(name)
    if row is None and key not in GPUS:
        raise ValueError(
            f"--gpu {name!r}: unknown; one of {', '.join(GPUS)}, or a device `builder plan --calibrate` measured"
        )
    row = row or GPUS[key]
    peak = overrides.pop("peak", None)
    if peak is not None:
        scale = peak / row.peak["bf16"]
        overrides["peak"] = {dtype: value * scale for dtype, value in row.peak.items()}
    for field_name, value in overrides.items():
        if field_name != "peak" and value is not None and not value > 0:
            raise ValueError(f"{field_name} must be positive, got {value!r}")
    return dataclasses.replace(row, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of ``memory`` bytes, ``per_node`` to a node, ``peak`` dense FLOP/s each in
    the compute dtype; ``hardware``: the GPU's row of ``yamlformer.builder.analysis.hardware`` (default the
    H100 SXM's, its memory and peak replaced by these)."""

    gpus: int
    per_node: int
    memory: int
    peak: float
    gpu: str = "H100 SXM"
    headroom: float = 0.10
    hardware: GPU | None = None
    #: the GPU's kernel rates (``yamlformer.builder.analysis.calibration.Calibration``); None: its table's,
    #: looked up by its name, or the reference's fractions of its datasheet
    calibration: object = None

    def __post_init__(self):
        base = self.hardware or gpu("h100")
        scale = self.peak / base.peak["bf16"]  # the stated peak, every dtype scaled with it
        row = dataclasses.replace(
            base,
            memory=self.memory,
            per_node=self.per_node,
            peak={dtype: value * scale for dtype, value in base.peak.items()},
        )
        object.__setattr__(self, "hardware", row)

    @property
    def nodes(self) -> int:
        return self.gpus // self.per_node

    @property
    def usable(self) -> int:
        return int(self.memory * (1 - self.headroom))

    def with_gpus(self, gpus: int) -> Cluster:
        return dataclasses.replace(self, gpus=gpus)
