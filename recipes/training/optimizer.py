"""The optimizer every task trains with: AdamW, fused into one kernel per step where torch has
one. Its parameter groups (decay on matrices only) are the LightningModule's
(``yamlformer.recipes.training.module.param_groups``); precision is :mod:`yamlformer.recipes.training.precision`."""

from __future__ import annotations

import torch


def adamw(groups: list[dict], **settings) -> torch.optim.AdamW:
    """AdamW with one fused kernel per step where torch has one for every parameter's device and
    dtype (CUDA, CPU, ...), else the multi-tensor (``foreach``) implementation."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    params = [p for g in groups for p in g["params"]]
    devices = set(_get_fused_kernels_supported_devices())
    fused = bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, **settings, **({"fused": True} if fused else {"foreach": True}))
