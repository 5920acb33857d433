"""Adapters a spec's ``adapters`` attaches to linear layers (``yamlformer.blocks.linear``): LoRA and DoRA.

An adapter module is built as ``Adapter(config, linear)`` (its config from
``yamlformer.blocks.configs.adapters``, the layer it adapts, for its shapes) and becomes that
layer's child ``adapter``; it keeps the :class:`yamlformer.blocks.linear.Adapter` contract and
asks its layer only what :class:`yamlformer.blocks.linear.AdaptedLayer` declares. Its forward
``forward(x, y, linear, **where)`` takes the layer's input ``x`` and its output ``y`` and returns
the adapted output; it multiplies through the layer's own ``project`` (``F.linear``, or each
expert's rows for stacked experts: ``where`` carries their counts), so the same class adapts one
projection or a stack of experts, whose factors are then stacked per expert (``lora_A``
``(n, r, in)``).

Both follow PEFT (``peft.tuners.lora``) exactly, so a PEFT adapter of the same rank computes the
same logits and trains alike:

* **LoRA** (Hu et al. 2021): ``y + scale * lora_B(lora_A(dropout(x)))``, ``scale = alpha / rank``
  (``rank_scaled``: ``alpha / sqrt(rank)``, rsLoRA); ``lora_A`` drawn as PEFT draws it
  (Kaiming-uniform, bound ``1/sqrt(in)``), ``lora_B`` zero, so the adapted model starts as the base.
* **DoRA** (Liu et al. 2024): the weight as a magnitude (``magnitude``, one per output feature,
  started at ``||W||`` row by row) times a direction ``(W + scale B A) / ||W + scale B A||``, the
  norm treated as a constant (the paper's section 4.3, PEFT's ``weight_norm.detach()``); with
  dropout, the base is recomputed on the dropped-out input, as PEFT does.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.linear import AdaptedLayer


class LoRA(nn.Module):
    """``y + scale * B(A(dropout(x)))`` (module doc)."""

    def __init__(self, config, linear: AdaptedLayer):
        super().__init__()
        stack = tuple(linear.weight.shape[:-2])  # (n,) for stacked experts, () for one projection
        out_features, in_features = linear.weight.shape[-2:]
        rank = config.rank
        self.scale = config.scale()
        self.in_features = in_features
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.feature_dims = type(config).feature_dims  # how tensor parallelism splits each tensor
        kind = {"device": linear.weight.device, "dtype": linear.weight.dtype}  # an NF4 weight: its original dtype
        self.lora_A = nn.Parameter(torch.empty(*stack, rank, in_features, **kind))
        self.lora_B = nn.Parameter(torch.empty(*stack, out_features, rank, **kind))
        if not self.lora_A.is_meta:  # PEFT's start until yamlformer.blocks.init draws it by the rules below
            self.lora_A.data.uniform_(-(in_features**-0.5), in_features**-0.5)
            self.lora_B.data.zero_()

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        """Kaiming-uniform ``lora_A`` (``a = sqrt(5)``: bound ``1/sqrt(in)``, PEFT's and
        ``nn.Linear``'s draw) and a zero ``lora_B``: the adapted model starts as the base."""
        return {"lora_A": ("uniform", self.in_features**-0.5), "lora_B": ("constant", 0.0)}

    def change(self, x: torch.Tensor, linear: AdaptedLayer, **where) -> torch.Tensor:
        """``scale * B(A(x))``: the adapter's own path."""
        return self.scale * linear.project(linear.project(x, self.lora_A, **where), self.lora_B, **where)

    def forward(self, x: torch.Tensor, y: torch.Tensor, linear: AdaptedLayer, **where) -> torch.Tensor:
        return y + self.change(self.dropout(x), linear, **where)

    def set_from_weight(self, linear: AdaptedLayer) -> None:
        """Nothing of LoRA's derives from the base weight (``B`` starts at zero whatever it is)."""

    def delta(self, linear: AdaptedLayer) -> torch.Tensor:
        """``scale * B @ A``: the change to ``linear``'s weight, shaped as it (stacked: one per expert)."""
        return self.scale * (linear.local(self.lora_B) @ linear.local(self.lora_A))

    def merged_weight(self, linear: AdaptedLayer) -> torch.Tensor:
        """The layer's weight with this adapter folded in (a merged export, MLA's absorbed path)."""
        weight = linear.dense_weight()
        return weight + self.delta(linear).to(weight.dtype)


class DoRA(LoRA):
    """``magnitude * (W + scale B A) / ||W + scale B A||`` applied to ``x`` (module doc)."""

    def __init__(self, config, linear: AdaptedLayer):
        super().__init__(config, linear)
        self.magnitude = nn.Parameter(torch.empty(linear.weight.shape[:-1], **_kind(self.lora_A)))
        if not self.magnitude.is_meta:
            self.set_from_weight(linear)

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        """LoRA's; the magnitude follows the base weight (:meth:`set_from_weight`), set once the
        weights are (``yamlformer.blocks.init``): 1 until then."""
        return {**super().init_rules(std), "magnitude": ("constant", 1.0)}

    @torch.no_grad()
    def set_from_weight(self, linear: AdaptedLayer) -> None:
        """The magnitude of the adapted weight, row by row: ``||W + scale B A||`` (``||W||`` while
        ``B`` is zero, as PEFT starts it)."""
        linear.local(self.magnitude).copy_(self._norm(linear).to(self.magnitude.dtype))

    def _norm(self, linear: AdaptedLayer) -> torch.Tensor:
        """``||W + scale B A||`` over the input features, ``(out,)`` (``(n, out)`` stacked), without
        gradient (the direction's norm is a constant: the module doc)."""
        weight = linear.dense_weight().detach()
        return torch.linalg.vector_norm(weight + self.delta(linear).detach().to(weight.dtype), dim=-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, linear: AdaptedLayer, **where) -> torch.Tensor:
        # PEFT's DoRA: with dropout in training, the base is recomputed on the dropped-out input
        recompute = self.training and not isinstance(self.dropout, nn.Identity)
        x = self.dropout(x)
        factor = (linear.local(self.magnitude) / self._norm(linear).to(self.magnitude.dtype)).to(y.dtype)
        if not recompute and linear.bias is None:  # y is the base: factor * (base + change)
            return linear.scale_outputs(y + self.change(x, linear, **where), factor, **where)
        base = linear.base(x, **where) if recompute else y - linear.bias
        adapted = linear.scale_outputs(base + self.change(x, linear, **where), factor, **where)
        return y + adapted - base  # base + bias + (factor - 1) * base + factor * change

    def merged_weight(self, linear: AdaptedLayer) -> torch.Tensor:
        adapted = super().merged_weight(linear)
        factor = linear.local(self.magnitude).detach() / torch.linalg.vector_norm(adapted, dim=-1)
        return adapted * factor.to(adapted.dtype)[..., None]


def _kind(t: torch.Tensor) -> dict:
    return {"device": t.device, "dtype": t.dtype}
