"""Norms: LayerNorm (with or without bias) and RMSNorm (with Gemma's unit offset).

Where a layer places its norms (``pre``, ``post``, ``sandwich``) is decided in
``yamlformer.blocks.layers``; a norm module only normalises. Both compute in fp32 and return the input's
dtype, as Hugging Face's Llama and T5 norms do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight (+ bias)`` over the last dimension."""

    def __init__(self, config, d_model: int):
        super().__init__()
        self.eps = config.eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if config.bias else None

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"weight": ("constant", 1.0), **({"bias": ("constant", 0.0)} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps)
        return out.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``; with ``unit_offset`` the scale is ``1 + weight``."""

    def __init__(self, config, d_model: int):
        super().__init__()
        self.eps = config.eps
        self.unit_offset = config.unit_offset
        init = torch.zeros(d_model) if config.unit_offset else torch.ones(d_model)
        self.weight = nn.Parameter(init)

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"weight": ("constant", 0.0 if self.unit_offset else 1.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
        return (normed * scale).to(x.dtype)
