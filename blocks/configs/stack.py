"""Architecture configs: which stacks a model has and how they connect.

The top-level ``architecture`` field of a spec names one of these.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from blocks.configs.base import BlockConfig
from blocks.registry import register


class _ArchitectureConfig(BlockConfig):
    #: the spec's stacks this architecture needs, in the order they run
    stacks: ClassVar[tuple[str, ...]]
    #: whether the decoder's self-attention is causal (an encoder's never is)
    causal: ClassVar[dict[str, bool]] = {"encoder": False, "decoder": True}


@register("stack", "blocks.stacks:DecoderOnlyModel")
class DecoderOnlyConfig(_ArchitectureConfig):
    """A causal stack (GPT, Llama)."""

    type: Literal["decoder-only"] = "decoder-only"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("decoder",)


@register("stack", "blocks.stacks:EncoderOnlyModel")
class EncoderOnlyConfig(_ArchitectureConfig):
    """A bidirectional stack (BERT)."""

    type: Literal["encoder-only"] = "encoder-only"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("encoder",)


@register("stack", "blocks.stacks:EncoderDecoderModel")
class EncoderDecoderConfig(_ArchitectureConfig):
    """An encoder and a causal decoder that cross-attends to it (the 2017 Transformer, T5)."""

    type: Literal["encoder-decoder"] = "encoder-decoder"
    examples: ClassVar[list[dict]] = [{}]  # no fields; tests count whole tiny models
    stacks: ClassVar[tuple[str, ...]] = ("encoder", "decoder")
