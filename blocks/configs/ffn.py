"""Feed-forward configs: MLP, gated linear units (SwiGLU, GeGLU) and mixture of experts."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from blocks.configs.base import BlockConfig
from blocks.registry import register

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]


class _DenseFFNConfig(BlockConfig):
    hidden_dim: int | None = Field(None, ge=1, description="Inner width; defaults to 4 * d_model.")
    bias: bool = Field(False, description="Biases on the inner and output projections.")

    n_in_projections: ClassVar[int]  # 1 (MLP) or 2 (GLU: gate and up)

    def resolved_hidden_dim(self, d_model: int) -> int:
        return self.hidden_dim if self.hidden_dim is not None else 4 * d_model

    def params(self, d_model: int) -> int:
        h, n = self.resolved_hidden_dim(d_model), self.n_in_projections
        weights = (n + 1) * d_model * h
        return weights + ((n * h + d_model) if self.bias else 0)

    def flops(self, d_model: int, tokens: int) -> int:
        return 2 * tokens * (self.n_in_projections + 1) * d_model * self.resolved_hidden_dim(d_model)

    def active_params(self, d_model: int) -> int:
        return self.params(d_model)


@register("ffn", "blocks.ffn:MLP")
class MLPConfig(_DenseFFNConfig):
    """Two projections with an activation between them (the 2017 Transformer, GPT-2, BERT)."""

    type: Literal["mlp"] = "mlp"
    activation: Activation = Field("gelu", description="relu | gelu | gelu_tanh | silu.")
    n_in_projections: ClassVar[int] = 1


@register("ffn", "blocks.ffn:GLU")
class GLUConfig(_DenseFFNConfig):
    """Gated linear unit: act(x W_gate) * (x W_up), then W_down (SwiGLU with silu, GeGLU with gelu)."""

    type: Literal["glu"] = "glu"
    activation: Activation = Field("silu", description="silu: SwiGLU; gelu or gelu_tanh: GeGLU.")
    n_in_projections: ClassVar[int] = 2


ExpertConfig = Annotated[Union[MLPConfig, GLUConfig], Field(discriminator="type")]


@register("ffn", "blocks.ffn:MoE")
class MoEConfig(BlockConfig):
    """Mixture of experts: a linear router picks top_k experts per token (Mixtral).

    Gates are the softmax over the chosen experts' logits; tokens go only to their experts.
    """

    type: Literal["moe"] = "moe"
    n_experts: int = Field(..., ge=1, description="Number of expert FFNs.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to; at most n_experts.")
    expert: ExpertConfig = Field(..., description="Each expert: an mlp or glu block.")

    @model_validator(mode="after")
    def _top_k(self):
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})"
            )
        return self

    def params(self, d_model: int) -> int:
        return d_model * self.n_experts + self.n_experts * self.expert.params(d_model)

    def active_params(self, d_model: int) -> int:
        return d_model * self.n_experts + self.top_k * self.expert.params(d_model)

    def flops(self, d_model: int, tokens: int) -> int:
        # Every token meets the router; each expert multiplies only the tokens sent to it,
        # tokens * top_k rows in all, whatever the routing.
        return 2 * tokens * d_model * self.n_experts + self.top_k * self.expert.flops(d_model, tokens)
