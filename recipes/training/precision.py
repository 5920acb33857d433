"""Precision, in one place: what this machine computes natively, what ``trainer.precision: auto``
means here, and the Lightning precision plugin that trains in it.

Clipping and the optimizer step, for every precision (PyTorch's AMP recipe):

* ``32``, ``bf16-true``: clip, step.
* ``bf16-mixed``: autocast has no loss scaler, so there is nothing to unscale: clip, step.
* ``16-mixed``: the loss is scaled; the gradients are unscaled first, then clipped, then the
  scaler steps (skipping a step whose gradients overflowed) and updates its scale.

Fused AdamW (``yamlformer.recipes.optim.torch_optimizers.adamw``) declares that it unscales inside its kernel
(``_step_supports_amp_scaling``). Lightning's own ``MixedPrecision`` refuses to clip for such an
optimizer under *any* mixed precision, bf16 included, which has nothing to unscale. The plugin
here keeps both: under 16-mixed it unscales before clipping (the scaler then hands the fused
kernel no scale, only the overflow flag, so the step neither unscales twice nor applies a step
that overflowed), and under bf16-mixed it clips as fp32 does.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from yamlformer.recipes.parallel.mesh import accelerator_of

#: recipe precision (``auto`` resolved by :func:`resolve_precision`) -> Lightning's name for it
LIGHTNING = {"32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed", "bf16-true": "bf16-true"}

# -- what the machine has -------------------------------------------------------------------------


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_bf16() -> str | None:
    """The instruction set this CPU computes bf16 matmuls with natively (``AMX`` or
    ``AVX512-BF16``), or None: then bf16 is emulated and slower than fp32."""
    capabilities = dict(torch.cpu.get_capabilities()) if hasattr(torch.cpu, "get_capabilities") else {}
    flags = _cpuinfo_flags()
    if capabilities.get("amx_bf16") or "amx_bf16" in flags:
        return "AMX"
    if capabilities.get("avx512_bf16") or "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def on_cuda(accelerator: str) -> bool:
    """Whether Lightning's ``accelerator`` setting puts this run on a CUDA GPU
    (:func:`yamlformer.recipes.parallel.mesh.accelerator_of` says what it resolves to here)."""

    return accelerator_of(accelerator) == "cuda" and torch.cuda.is_available()


def estimate_dtype(precision: str) -> str:
    """The dtype the estimates count a run of ``precision`` (a concrete Lightning precision) in:
    ``bf16``, ``fp16`` or ``fp32``."""
    return "bf16" if precision.startswith("bf16") else "fp16" if precision == "16-mixed" else "fp32"


def cuda_bf16() -> bool:
    """Whether the CUDA device computes bf16 natively (Ampere and later)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


# -- what auto means ------------------------------------------------------------------------------


def resolve_precision(precision: str, accelerator: str) -> tuple[str, str | None]:
    """The recipe's precision made concrete for this machine, and a line to print about it.

    ``auto`` is the fastest precision that keeps quality here:

    * a CUDA GPU with native bf16 (Ampere and later): ``bf16-mixed``; an older one: ``32``;
    * a CPU with AMX or AVX512-BF16: ``bf16-mixed``. Measured side by side on a 2-core AVX512-BF16
      CPU (``benchmarks/precision.py``, ``benchmarks/RESULTS.md``): bf16 autocast trained the shipped
      recipes faster than fp32, eager and compiled, down to d_model 128, with level losses;
    * any other CPU: ``32`` (bf16 is emulated there and slower than fp32).

    An explicit bf16 precision on a CPU that emulates bf16 is kept, with a warning."""
    if on_cuda(accelerator):
        if precision == "auto":
            return ("bf16-mixed", None) if cuda_bf16() else ("32", "precision auto: fp32 (this GPU has no native bf16)")
        return precision, None
    native = cpu_bf16()
    if precision == "auto":
        if native:
            return "bf16-mixed", (
                f"precision auto: bf16-mixed (this CPU has {native}; bf16 autocast measured faster "
                "than fp32 on such CPUs, benchmarks/RESULTS.md)"
            )
        return "32", (
            "precision auto: fp32; this CPU has neither AMX nor AVX512-BF16, so bf16 would be "
            "emulated and slower than fp32"
        )
    if precision.startswith("bf16") and not native:
        return precision, (
            f"warning: precision {precision} on a CPU without AMX or AVX512-BF16 is emulated "
            "and slower than fp32; set trainer.precision: auto or 32 for speed"
        )
    return precision, None


# -- the Lightning plugin -------------------------------------------------------------------------


def _unscaling_optimizer(optimizer) -> bool:
    """Whether the optimizer unscales fp16 gradients inside its step (fused AdamW does)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class ClippingMixedPrecision(MixedPrecision):
    """Lightning's autocast plugin, clipping correctly with any optimizer (the module doc)."""

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        if self.scaler is None or not _unscaling_optimizer(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

        def unscaled_closure():
            result = closure()
            if result is not None or not model.automatic_optimization:  # a step follows (Lightning's rule)
                self.scaler.unscale_(optimizer)  # before clipping; the scaler then passes no scale on
            return result

        return super().optimizer_step(optimizer, model=model, closure=unscaled_closure, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        # unscaled by now (16-mixed) or never scaled (bf16-mixed): clip as fp32 does, fused or not
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


def matmul_precision(setting: str, precision: str) -> str:
    """``torch.set_float32_matmul_precision``'s value for ``trainer.matmul_precision`` under a
    concrete ``precision``: ``auto`` is ``high`` (TF32) unless the recipe trains in ``32``."""
    if setting != "auto":
        return setting
    return "highest" if precision == "32" else "high"


def lightning_plugin(precision: str, device: str, sharded: bool = False) -> Precision:
    """Lightning's precision plugin for a resolved recipe precision on ``device`` (``cpu`` or
    ``cuda``). ``sharded``: under FSDP2 (``yamlformer.recipes.parallel``) its mixed-precision policy casts,
    so the plugin casts nothing for bf16-mixed, and gradients clip across device meshes."""
    if sharded:
        # local: the sharded strategy (torch.distributed) loads for an fsdp run only; the dry run reads this module
        from yamlformer.recipes.parallel.strategy import MeshClipping

        if precision == "bf16-true":
            return type("ShardedHalfPrecision", (MeshClipping, HalfPrecision), {})("bf16-true")
        return type("ShardedPrecision", (MeshClipping, Precision), {})()
    if precision in ("bf16-mixed", "16-mixed"):
        return ClippingMixedPrecision(precision, device)
    if precision == "bf16-true":
        return HalfPrecision("bf16-true")
    return Precision()
