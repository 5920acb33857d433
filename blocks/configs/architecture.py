"""Architecture configs: which stacks a model has and how they connect.

The top-level ``architecture`` field of a spec names one of these.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from yamlformer.blocks.configs.base import ArchitectureBlock
from yamlformer.blocks.registry import register


@register("architecture", "yamlformer.blocks.stacks:DecoderOnlyModel")
class DecoderOnlyConfig(ArchitectureBlock):
    """A causal stack (GPT, Llama)."""

    type: Literal["decoder-only"] = "decoder-only"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("decoder",)


@register("architecture", "yamlformer.blocks.stacks:EncoderOnlyModel")
class EncoderOnlyConfig(ArchitectureBlock):
    """A bidirectional stack (BERT)."""

    type: Literal["encoder-only"] = "encoder-only"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("encoder",)


@register("architecture", "yamlformer.blocks.stacks:EncoderDecoderModel")
class EncoderDecoderConfig(ArchitectureBlock):
    """An encoder and a causal decoder that cross-attends to it (the 2017 Transformer, T5)."""

    type: Literal["encoder-decoder"] = "encoder-decoder"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("encoder", "decoder")
    memory_of: ClassVar[dict[str, str]] = {"decoder": "encoder"}
