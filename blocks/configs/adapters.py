"""Adapter configs: LoRA and DoRA on a spec's linear layers (``adapters:``), their fields and exact
counts per adapted layer. Torch-free; the modules are ``yamlformer.blocks.adapters``."""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.blocks import registry
from yamlformer.blocks.configs.base import KIND_BASES, BlockConfig, Shapes, rule_error
from yamlformer.blocks.configs.linear import LinearLayer
from yamlformer.blocks.limits import MAX_WIDTH
from yamlformer.blocks.registry import register

#: NF4 (QLoRA, torchao's NF4Tensor): values per block, each block with its own scale, and scales per
#: second-level block (the scales double-quantized to int8, a factor per block of them)
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
#: the 16 NormalFloat levels and the scales' mean, kept in the weight's original dtype
NF4_TABLE = 16 + 1


def nf4_scaler_block(blocks: int, preferred: int = NF4_SCALER_BLOCK) -> int:
    """The scaler block an NF4 weight of ``blocks`` blocks takes: ``preferred`` when it divides
    them (every weight of a model whose widths are multiples of 128), else the largest power of
    two that does (a small model's weights)."""
    if blocks % preferred == 0:
        return preferred
    return blocks & -blocks  # the largest power of two dividing blocks


def nf4_bytes(elements: int, dtype_bytes: int) -> int:
    """What torchao's NF4Tensor of ``elements`` values (from a weight of ``dtype_bytes`` bytes each)
    stores: 4 bits a value, an int8 scale a block, a factor of the weight's dtype per scaler block,
    and the level table and scales' mean."""
    blocks = elements // NF4_BLOCK
    factors = blocks // nf4_scaler_block(blocks)
    return elements // 2 + blocks + (factors + NF4_TABLE) * dtype_bytes


#: ``adapters.targets`` shorthand: every linear layer of the stacks' layers (as PEFT's
#: ``all-linear`` leaves the output layer out, this leaves the head out: name its layers to adapt them)
ALL_LINEAR = "all-linear"
#: one part of an adapter target: a module name, a layer index, a range of them (both ends included), or *
TARGET_SEGMENT = r"(?:\*|[A-Za-z_][A-Za-z0-9_]*|\d+(?:-\d+)?)"


class AdapterBlock(BlockConfig):
    """An adapter on linear layers: a spec's ``adapters``. Its module ``Adapter(config, linear)``
    becomes each target layer's ``adapter`` (``yamlformer.blocks.linear``, the module protocol in
    ``yamlformer.blocks.adapters``); the spec's base parameters no longer train. ``targets`` and
    ``quantize`` are every adapter's; the counts are per adapted layer
    (:class:`LinearLayer`), summed by ``yamlformer.builder``."""

    #: for each tensor the adapter adds to a layer: its dim that runs along the layer's output
    #: features and the one along its input features (negative, so a stacked layer's leading
    #: expert dim does not count; None: neither). Tensor parallelism splits a tensor where its
    #: layer's weight is split: a column-parallel layer's on the output dim, a row-parallel one's on the input dim
    feature_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {}

    targets: (
        Annotated[list[Annotated[str, Field(max_length=200)]], Field(min_length=1, max_length=256)]
        | Literal["all-linear"]
    ) = Field(
        ...,
        description="The linear layers adapted, by dotted path of module names: `decoder.layers.*.attention.q_proj`, "
        "`decoder.layers.0-3.ffn` (every linear layer under it), `q_proj` (every layer of that name: a path that "
        "does not start at the model's root matches anywhere); layer indices, ranges (0-3, both ends included) "
        "and * per part; or `all-linear`, every linear layer of the stacks' layers (the head's are named).",
    )
    quantize: Literal["nf4"] | None = Field(
        None,
        description="nf4: the frozen base weight of every 2-D linear layer of the stacks' layers stored as "
        "4-bit NormalFloat (QLoRA, torchao's NF4Tensor: blocks of 64 values, scales double-quantized); stacked "
        "experts and the head stay as they are. null: the base in the model's dtype.",
    )

    @model_validator(mode="after")
    def _target_paths(self):
        if self.targets == ALL_LINEAR:
            return self
        path = re.compile(rf"{TARGET_SEGMENT}(?:\.{TARGET_SEGMENT})*")
        for i, target in enumerate(self.targets):
            if not path.fullmatch(target):
                raise rule_error(
                    ("targets", i),
                    f"{target!r} is not a dotted path of module names, layer indices (3), ranges (0-3) or *",
                )
            for low, high in re.findall(r"(?:^|\.)(\d+)-(\d+)(?=\.|$)", target):
                if int(low) > int(high):
                    raise rule_error(
                        ("targets", i), f"{target!r}: the range {low}-{high} runs backwards; write {high}-{low}"
                    )
        return self

    @abstractmethod
    def param_shapes(self, layer: LinearLayer) -> Shapes:
        """The tensors this adapter adds to ``layer``, by name under its ``adapter`` module (a
        stacked layer's with the experts' dim first)."""

    @abstractmethod
    def flops(self, layer: LinearLayer, tokens: int) -> int:
        """Forward FLOPs the adapter adds to ``layer`` over ``tokens`` tokens of its block's input
        (``layer.rows`` rows each)."""

    @abstractmethod
    def saved_bytes(self, layer: LinearLayer, tokens: int, act_bytes: int) -> int:
        """Bytes the adapter keeps for backward over ``tokens`` tokens of its block's input."""

    def params(self, layer: LinearLayer) -> int:
        total = 0
        for shape in self.param_shapes(layer).values():
            n = 1
            for size in shape:
                n *= size
            total += n
        return total

    def tensor_parallel_dim(self, name: str, style: str | None) -> int | None:
        """The dim of tensor ``name`` tensor parallelism splits when its layer's plan is ``style``
        (``colwise``, ``vocab``: the output features; ``rowwise``: the input features; else none)."""
        out_dim, in_dim = self.feature_dims.get(name, (None, None))
        if style in ("colwise", "vocab"):
            return out_dim
        if style == "rowwise":
            return in_dim
        return None


#: the adapter kind's contract, here beside its types rather than in ``base.py`` (which it would
#: take past its size): registering a type below checks it against this
KIND_BASES["adapter"] = AdapterBlock
registry.declare_contracts({"adapter": AdapterBlock})


@register("adapter", "yamlformer.blocks.adapters:LoRA")
class LoRAConfig(AdapterBlock):
    """LoRA (Hu et al. 2021): ``W x + (alpha / rank) B A x``, ``A`` ``(rank, in)`` and ``B``
    ``(out, rank)`` trained, ``W`` frozen; PEFT's ``LoraConfig`` field for field."""

    type: Literal["lora"] = "lora"
    rank: int = Field(8, ge=1, le=MAX_WIDTH, description="The rank r of each update B A (PEFT's `r`).")
    alpha: float = Field(16.0, gt=0, le=1e6, description="The update is scaled by alpha / rank (PEFT's `lora_alpha`).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (PEFT's `lora_dropout`).")
    rank_scaled: bool = Field(
        False, description="Scale by alpha / sqrt(rank) instead (rsLoRA, Kalajdzievski 2023; PEFT's `use_rslora`)."
    )

    feature_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {"lora_A": (None, -1), "lora_B": (-2, None)}
    examples: ClassVar[list[dict]] = [
        {"targets": "all-linear"},
        {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
        {"rank": 2, "rank_scaled": True, "targets": ["decoder.layers.0.ffn"]},
    ]

    def scale(self) -> float:
        """What the update ``B A`` is multiplied by."""
        return self.alpha / math.sqrt(self.rank) if self.rank_scaled else self.alpha / self.rank

    def describe(self) -> str:
        return f"{self.type} r{self.rank}" + (f" {self.quantize}" if self.quantize else "")

    def param_shapes(self, layer: LinearLayer) -> Shapes:
        stack = (layer.stacked,) if layer.stacked is not None else ()
        return {"lora_A": (*stack, self.rank, layer.in_), "lora_B": (*stack, layer.out, self.rank)}

    def flops(self, layer: LinearLayer, tokens: int) -> int:
        return round(2 * tokens * layer.rows * self.rank * (layer.in_ + layer.out))

    def saved_bytes(self, layer: LinearLayer, tokens: int, act_bytes: int) -> int:
        # A's output (for B's gradient); the input A reads is the layer's, which its block counts,
        # unless dropout makes a copy (and a one-byte mask)
        rows = round(tokens * layer.rows)
        dropped = rows * layer.in_ * (act_bytes + 1) if self.dropout > 0 else 0
        return rows * self.rank * act_bytes + dropped


@register("adapter", "yamlformer.blocks.adapters:DoRA")
class DoRAConfig(LoRAConfig):
    """DoRA (Liu et al. 2024): a trained magnitude per output feature times the direction
    ``(W + scale B A) / ||W + scale B A||`` (PEFT's ``use_dora``)."""

    type: Literal["dora"] = "dora"

    feature_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {
        **LoRAConfig.feature_dims,
        "magnitude": (-1, None),
    }
    examples: ClassVar[list[dict]] = [
        {"targets": "all-linear"},
        {"rank": 4, "alpha": 4, "dropout": 0.1, "targets": ["attention"]},
    ]

    def param_shapes(self, layer: LinearLayer) -> Shapes:
        stack = (layer.stacked,) if layer.stacked is not None else ()
        return {**super().param_shapes(layer), "magnitude": (*stack, layer.out)}

    def flops(self, layer: LinearLayer, tokens: int) -> int:
        # and B A once per forward, for the direction's norm
        return super().flops(layer, tokens) + 2 * (layer.stacked or 1) * layer.out * self.rank * layer.in_

    def saved_bytes(self, layer: LinearLayer, tokens: int, act_bytes: int) -> int:
        # and the unscaled adapted output, for the magnitude's gradient
        return super().saved_bytes(layer, tokens, act_bytes) + round(tokens * layer.rows) * layer.out * act_bytes
