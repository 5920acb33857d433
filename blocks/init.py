"""Weight initialisation, GPT-2 style.

* linear and embedding weights: normal(0, 0.02); biases: 0;
* norm scales: 1 (0 for RMSNorm with ``unit_offset``, whose scale is ``1 + weight``);
  LayerNorm biases: 0;
* residual projections (attention ``out_proj`` and the FFN ``down_proj``, inside MoE experts
  too): normal(0, 0.02 / sqrt(2 * n_layers)), ``n_layers`` of the stack they sit in (GPT-2).
* learned position tables and T5's relative-bias table: normal(0, 0.02).

Seed with ``torch.manual_seed`` before building. Nothing is done for meta tensors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blocks.norms import LayerNorm, RMSNorm
from blocks.positions import Learned, RelativeBias

STD = 0.02
RESIDUAL_PROJECTIONS = ("out_proj", "down_proj")


@torch.no_grad()
def init_weights(model: nn.Module, std: float = STD) -> nn.Module:
    if any(p.is_meta for p in model.parameters()):
        return model
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Embedding, Learned, RelativeBias)):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, RMSNorm):
            nn.init.constant_(module.weight, 0.0 if module.unit_offset else 1.0)
        elif isinstance(module, LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    stacks = model.stacks() if hasattr(model, "stacks") else {}
    for stack in stacks.values():
        residual_std = std / math.sqrt(2 * stack.n_layers)
        for name, module in stack.layers.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS:
                nn.init.normal_(module.weight, 0.0, residual_std)
    return model
