"""Norm configs: LayerNorm and RMSNorm, and where a layer places them."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from yamlformer.blocks.configs.base import Classes, NormBlock, Placement, Shapes
from yamlformer.blocks.configs.tensors import vector
from yamlformer.blocks.configs.traffic import Traffic, rms_norm
from yamlformer.blocks.limits import MAX_FACTOR
from yamlformer.blocks.registry import register

__all__ = ["LayerNormConfig", "RMSNormConfig", "Placement"]


class _NormConfig(NormBlock):
    """What the built-in norms share; yamlformer.blocks.norms computes in fp32."""

    eps: float = Field(1e-5, gt=0, le=MAX_FACTOR, description="Added to the variance for numerical stability.")

    def tensor_classes(self, d_model: int) -> Classes:
        return dict.fromkeys(self.param_shapes(d_model), vector())  # a gain (and a bias) per channel


@register("norm", "yamlformer.blocks.norms:LayerNorm")
class LayerNormConfig(_NormConfig):
    """LayerNorm (Ba et al. 2016): subtract the mean, divide by the standard deviation."""

    type: Literal["layernorm"] = "layernorm"
    bias: bool = Field(True, description="A learned bias (beta) after the scale.")

    examples: ClassVar[list[dict]] = [{}, {"bias": False, "eps": 1e-6}, {"placement": "post"}]

    def params(self, d_model: int) -> int:
        return d_model * (2 if self.bias else 1)

    def param_shapes(self, d_model: int) -> Shapes:
        return {"weight": (d_model,), **({"bias": (d_model,)} if self.bias else {})}

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        # F.layer_norm keeps its fp32 input and an fp32 mean and 1/std per token, and in a
        # 16-bit dtype the fp32 copies of its weight and bias (fp32 parameters are kept as they are)
        copies = 0 if act_bytes == 4 else self.params(d_model) * 4
        return tokens * (4 * d_model + 2 * 4) + copies


@register("norm", "yamlformer.blocks.norms:RMSNorm")
class RMSNormConfig(_NormConfig):
    """RMSNorm (Zhang & Sennrich 2019): divide by the root mean square; no mean, no bias."""

    type: Literal["rmsnorm"] = "rmsnorm"
    unit_offset: bool = Field(
        False,
        description="Scale by (1 + weight) with the weight initialised to 0 (Gemma), "
        "instead of by weight initialised to 1.",
    )

    examples: ClassVar[list[dict]] = [
        {},
        {"unit_offset": True},
        {"placement": "sandwich", "eps": 1e-6},
        {"placement": "post_sublayer", "eps": 1e-6},  # OLMo 2
    ]

    def params(self, d_model: int) -> int:
        return d_model

    def param_shapes(self, d_model: int) -> Shapes:
        return {"weight": (d_model,)}

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        return rms_norm(d_model, act_bytes)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        # x.float() (kept by pow and the multiply), the fp32 1/rms per token, the normalised x
        # (kept by the multiply with the weight), and in a 16-bit dtype the weight's fp32 copy
        return tokens * (2 * 4 * d_model + 4) + (0 if act_bytes == 4 else 4 * d_model)
