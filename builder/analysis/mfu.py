"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak.

``mfu = tokens_per_s * flops_per_token / peak``. Use the estimate's ``train_per_token`` (3x
forward, the attention matrix counted in full as eager attention computes it) for the MFU that
PaLM and nanoGPT report, or ``kernel_train_per_token`` (only the (query, key) pairs a tiled
kernel visits under a causal mask or window) for the FLOPs a fused kernel really performs.

Peaks are the vendors' datasheet figures for dense matrix math (without 2:4 sparsity, i.e. half
the headline "with sparsity" numbers), in FLOP/s; ``yamlformer.builder.analysis.hardware`` holds the rest
of each GPU's row (memory, HBM and link bandwidths) for the planner. A figure a datasheet does
not give is absent (``peak_flops`` returns None). ``fp32`` is the non-tensor-core FP32 rate;
``tf32`` the tensor-core rate PyTorch uses for fp32 matmuls with
``torch.backends.cuda.matmul.allow_tf32``. A peak passed as an argument wins over the
``BUILDER_PEAK_FLOPS`` environment variable (FLOP/s, e.g. ``989e12``), which wins over the table.

Torch-free: the caller names the device (``torch.cuda.get_device_name()``).
"""

from __future__ import annotations

import os

ENV_VAR = "BUILDER_PEAK_FLOPS"
T = 1e12

#: dense peak FLOP/s by device and dtype, from the NVIDIA and AMD datasheets
PEAKS: dict[str, dict[str, float]] = {
    # A100 (SXM4 and PCIe, 40 and 80 GB): 312 TF bf16/fp16, 156 TF tf32, 19.5 TF fp32
    "A100": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    # H100 SXM5 (reports as "NVIDIA H100 80GB HBM3"): 1,979 TF bf16 with sparsity
    "H100 SXM": {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    # H100 PCIe: 1,513 TF bf16 with sparsity
    "H100 PCIe": {"bf16": 756.5 * T, "fp16": 756.5 * T, "tf32": 378 * T, "fp32": 51 * T},
    # H100 NVL: 1,671 TF bf16 with sparsity
    "H100 NVL": {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    # H200 SXM (and GH200): the H100 SXM's compute with HBM3e
    "H200": {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    # H200 NVL: 1,671 TF bf16 with sparsity
    "H200 NVL": {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    # H800 SXM: the H100 SXM's compute (its NVLink is what differs)
    "H800": {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    # B200 (HGX B200 datasheet): 4.5 PF fp16/bf16 and 2.2 PF tf32 with sparsity; no fp32 figure here
    "B200": {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1125 * T},
    # AMD Instinct MI300X data sheet: 1,307.4 TF bf16/fp16 and 653.7 TF tf32 (dense)
    "MI300X": {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T},
}

DTYPES = ("bf16", "fp16", "tf32", "fp32")


def match_device(device_name: str) -> str | None:
    """The :data:`PEAKS` key for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``."""
    name = device_name.lower()
    for part, key in (("h800", "H800"), ("b200", "B200"), ("mi300x", "MI300X")):
        if part in name:
            return key
    if "h200" in name:
        return "H200 NVL" if "nvl" in name else "H200"
    if "h100" in name:
        if "nvl" in name:
            return "H100 NVL"
        return "H100 PCIe" if "pcie" in name else "H100 SXM"
    if "a100" in name:
        return "A100"
    return None


def peak_flops(device_name: str | None, dtype: str, override: float | None = None) -> float | None:
    """Dense peak FLOP/s of ``device_name`` (a CUDA device's name, ``"cpu"``) in ``dtype``; None
    for a device not in the table (or none named).

    ``override`` (FLOP/s) wins, then the ``BUILDER_PEAK_FLOPS`` environment variable.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if override is not None:
        return _positive(override, "peak override")
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR}={env!r} is not a number of FLOP/s (e.g. 989e12)") from None
        return _positive(value, ENV_VAR)
    if device_name is None:
        return None
    key = match_device(device_name)
    return PEAKS[key].get(dtype) if key is not None else None


def achieved_flops(tokens_per_s: float, flops_per_token: float) -> float:
    """FLOP/s a run achieves at ``tokens_per_s`` with ``flops_per_token`` per token."""
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError("tokens_per_s and flops_per_token must be non-negative")
    return tokens_per_s * flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation in [0, 1] (more than 1 means the peak or the count is wrong)."""
    if not peak or peak <= 0:
        raise ValueError(f"peak must be a positive FLOP/s figure, got {peak!r}")
    return achieved_flops(tokens_per_s, flops_per_token) / peak


def _positive(value: float, what: str) -> float:
    if not value > 0:
        raise ValueError(f"{what} must be a positive FLOP/s figure, got {value!r}")
    return float(value)
