"""AdamW and SGD over the groups their configs declare (``yamlformer.builder.optim.configs``): torch's
own classes. Precision is :mod:`yamlformer.recipes.training.precision` (fused AdamW unscales in its kernel)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from yamlformer.recipes.optim.implementations import implements


def fused_kernels(params: list[torch.Tensor]) -> bool:
    """Whether torch has a fused optimizer kernel for every parameter's device and dtype."""
    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)


@implements("adamw")
def adamw(config, groups: list[dict]) -> torch.optim.AdamW:
    """AdamW with one fused kernel per step where torch has one for every parameter's device and
    dtype (CUDA, CPU, ...), else the multi-tensor (``foreach``) implementation."""
    fused = fused_kernels([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, eps=config.eps, **({"fused": True} if fused else {"foreach": True})
    )


@implements("sgd")
def sgd(config, groups: list[dict]) -> torch.optim.SGD:
    """SGD with momentum, multi-tensor."""
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, foreach=True)
