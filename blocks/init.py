"""Weight initialisation, GPT-2 style.

* linear and embedding weights: normal(0, 0.02); biases: 0;
* norm scales: 1 (0 for RMSNorm with ``unit_offset``, whose scale is ``1 + weight``);
  LayerNorm biases: 0;
* residual projections (attention ``out_proj`` and the FFN ``down_proj``, inside MoE experts
  too): normal(0, 0.02 / sqrt(2 * n_layers)), ``n_layers`` of the stack they sit in (GPT-2).
* learned position tables and T5's relative-bias table: normal(0, 0.02).

A block module with parameters of its own (not inside an ``nn.Linear`` or ``nn.Embedding``
child) initialises them in an ``init_weights(std)`` method, which this calls (norms, learned
tables; a plugin block's own tensors). Seed with ``torch.manual_seed`` before building. Nothing
is done for meta tensors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

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
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif callable(getattr(module, "init_weights", None)):
            module.init_weights(std)
    stacks = model.stacks() if hasattr(model, "stacks") else {}
    for stack in stacks.values():
        residual_std = std / math.sqrt(2 * stack.n_layers)
        for name, module in stack.layers.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS:
                nn.init.normal_(module.weight, 0.0, residual_std)
    return model
