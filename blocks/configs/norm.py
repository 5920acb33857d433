"""Norm configs: LayerNorm and RMSNorm, and where a layer places them."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from blocks.configs.base import BlockConfig
from blocks.registry import register

Placement = Literal["pre", "post", "sandwich"]


class _NormConfig(BlockConfig):
    eps: float = Field(1e-5, gt=0, description="Added to the variance for numerical stability.")
    placement: Placement = Field(
        "pre",
        description="pre: norm before each sub-layer (GPT-2, Llama); post: after the residual "
        "add (the 2017 Transformer, BERT); sandwich: before and after each sub-layer (Gemma 2).",
    )

    #: fp32 statistics per token kept for backward (LayerNorm: mean and 1/std; RMSNorm: 1/rms)
    saved_stats: ClassVar[int]

    def params(self, d_model: int) -> int:
        raise NotImplementedError

    @property
    def per_sublayer(self) -> int:
        """Norms around each sub-layer (attention, cross-attention, FFN): 2 for sandwich."""
        return 2 if self.placement == "sandwich" else 1

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward: the input, and the fp32 statistics per token."""
        return tokens * (d_model * act_bytes + 4 * self.saved_stats)


@register("norm", "blocks.norms:LayerNorm")
class LayerNormConfig(_NormConfig):
    """LayerNorm (Ba et al. 2016): subtract the mean, divide by the standard deviation."""

    type: Literal["layernorm"] = "layernorm"
    bias: bool = Field(True, description="A learned bias (beta) after the scale.")

    saved_stats: ClassVar[int] = 2
    examples: ClassVar[list[dict]] = [{}, {"bias": False, "eps": 1e-6}, {"placement": "post"}]

    def params(self, d_model: int) -> int:
        return d_model * (2 if self.bias else 1)


@register("norm", "blocks.norms:RMSNorm")
class RMSNormConfig(_NormConfig):
    """RMSNorm (Zhang & Sennrich 2019): divide by the root mean square; no mean, no bias."""

    type: Literal["rmsnorm"] = "rmsnorm"
    unit_offset: bool = Field(
        False,
        description="Scale by (1 + weight) with the weight initialised to 0 (Gemma), "
        "instead of by weight initialised to 1.",
    )

    saved_stats: ClassVar[int] = 1
    examples: ClassVar[list[dict]] = [{}, {"unit_offset": True}, {"placement": "sandwich", "eps": 1e-6}]

    def params(self, d_model: int) -> int:
        return d_model
