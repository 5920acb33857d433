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

    def params(self, d_model: int) -> int:
        raise NotImplementedError

    @property
    def per_sublayer(self) -> int:
        """Norms around each sub-layer (attention, cross-attention, FFN): 2 for sandwich."""
        return 2 if self.placement == "sandwich" else 1

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see builder.memory); blocks.norms computes in fp32."""
        raise NotImplementedError


@register("norm", "blocks.norms:LayerNorm")
class LayerNormConfig(_NormConfig):
    """LayerNorm (Ba et al. 2016): subtract the mean, divide by the standard deviation."""

    type: Literal["layernorm"] = "layernorm"
    bias: bool = Field(True, description="A learned bias (beta) after the scale.")

    examples: ClassVar[list[dict]] = [{}, {"bias": False, "eps": 1e-6}, {"placement": "post"}]

    def params(self, d_model: int) -> int:
        return d_model * (2 if self.bias else 1)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        # F.layer_norm keeps its fp32 input and an fp32 mean and 1/std per token
        return tokens * (4 * d_model + 2 * 4)


@register("norm", "blocks.norms:RMSNorm")
class RMSNormConfig(_NormConfig):
    """RMSNorm (Zhang & Sennrich 2019): divide by the root mean square; no mean, no bias."""

    type: Literal["rmsnorm"] = "rmsnorm"
    unit_offset: bool = Field(
        False,
        description="Scale by (1 + weight) with the weight initialised to 0 (Gemma), "
        "instead of by weight initialised to 1.",
    )

    examples: ClassVar[list[dict]] = [{}, {"unit_offset": True}, {"placement": "sandwich", "eps": 1e-6}]

    def params(self, d_model: int) -> int:
        return d_model

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        # x.float() (kept by pow and the multiply), the fp32 1/rms per token, the normalised x
        # (kept by the multiply with the weight)
        return tokens * (2 * 4 * d_model + 4)
