"""One layer of a stack, resolved: the blocks a layer is built from after the stack's
``overrides`` (``builder.spec.schema.StackSpec.layer``). Torch-free."""

from __future__ import annotations

import dataclasses

from blocks.configs.base import AttentionBlock, FFNBlock, NormBlock


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """A layer's blocks. ``cross_attention`` is what a cross-attending stack's layer uses (the
    stack's ``cross_attention``, else its self-attention without ``not_inherited_by_cross``)."""

    attention: AttentionBlock
    cross_attention: AttentionBlock | None
    ffn: FFNBlock
    norm: NormBlock
    dropout: float

    def sublayers(self, cross: bool) -> tuple[str, ...]:
        """The residual sub-layers in order; each gets ``norm.per_sublayer`` norms."""
        return ("attention", "cross_attention", "ffn") if cross else ("attention", "ffn")

    def describe(self, cross: bool) -> str:
        """A short label: ``8h/4kv w4096 +cross glu rmsnorm``."""
        return (
            self.attention.describe() + (" +cross" if cross else "") + f" {self.ffn.describe()} {self.norm.describe()}"
        )
