"""Feed-forward configs: MLP, gated linear units (SwiGLU, GeGLU) and mixture of experts."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from blocks.configs.base import FFNBlock, Problems, Shapes, indivisible, rule_error
from blocks.registry import register

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]


class _DenseFFNConfig(FFNBlock):
    hidden_dim: int | None = Field(None, ge=1, description="Inner width; defaults to 4 * d_model.")
    bias: bool = Field(False, description="Biases on the inner and output projections.")

    n_in_projections: ClassVar[int]  # 1 (MLP) or 2 (GLU: gate and up)
    in_projections: ClassVar[tuple[str, ...]]  # their module names

    def resolved_hidden_dim(self, d_model: int) -> int:
        return self.hidden_dim if self.hidden_dim is not None else 4 * d_model

    def params(self, d_model: int) -> int:
        h, n = self.resolved_hidden_dim(d_model), self.n_in_projections
        weights = (n + 1) * d_model * h
        return weights + ((n * h + d_model) if self.bias else 0)

    def param_shapes(self, d_model: int) -> Shapes:
        h = self.resolved_hidden_dim(d_model)
        shapes: Shapes = {}
        for name in self.in_projections:
            shapes[f"{name}.weight"] = (h, d_model)
            if self.bias:
                shapes[f"{name}.bias"] = (h,)
        shapes["down_proj.weight"] = (d_model, h)
        if self.bias:
            shapes["down_proj.bias"] = (d_model,)
        return shapes

    def parallel_plan(self) -> dict[str, str]:
        # Megatron's MLP: the hidden width split, down_proj sums the ranks' parts
        return {**{name: "colwise" for name in self.in_projections}, "down_proj": "rowwise"}

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        return indivisible(degree, hidden_dim=self.resolved_hidden_dim(d_model))

    def tensor_parallel(self, degree: int, d_model: int) -> _DenseFFNConfig:
        """``hidden_dim / degree`` of the hidden width."""
        return self.model_copy(update={"hidden_dim": self.resolved_hidden_dim(d_model) // degree})

    def flops(self, d_model: int, tokens: int) -> int:
        return 2 * tokens * (self.n_in_projections + 1) * d_model * self.resolved_hidden_dim(d_model)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see builder.memory): the input and the hidden tensors."""
        return tokens * (d_model + self.saved_hidden * self.resolved_hidden_dim(d_model)) * act_bytes

    @property
    def saved_hidden(self) -> int:
        """Hidden-width tensors kept for backward per token."""
        raise NotImplementedError


@register("ffn", "blocks.ffn:MLP")
class MLPConfig(_DenseFFNConfig):
    """Two projections with an activation between them (the 2017 Transformer, GPT-2, BERT)."""

    type: Literal["mlp"] = "mlp"
    activation: Activation = Field("gelu", description="relu | gelu | gelu_tanh | silu.")
    n_in_projections: ClassVar[int] = 1
    in_projections: ClassVar[tuple[str, ...]] = ("up_proj",)
    examples: ClassVar[list[dict]] = [
        {"activation": "gelu", "bias": True},
        {"activation": "relu", "hidden_dim": 40},
        {"activation": "gelu_tanh"},
        {"activation": "silu", "hidden_dim": 24, "bias": True},
    ]

    @property
    def saved_hidden(self) -> int:
        # the activation's input and its output (the down projection's input); relu saves its
        # output, which is that same tensor
        return 1 if self.activation == "relu" else 2


@register("ffn", "blocks.ffn:GLU")
class GLUConfig(_DenseFFNConfig):
    """Gated linear unit: act(x W_gate) * (x W_up), then W_down (SwiGLU with silu, GeGLU with gelu)."""

    type: Literal["glu"] = "glu"
    activation: Activation = Field("silu", description="silu: SwiGLU; gelu or gelu_tanh: GeGLU.")
    n_in_projections: ClassVar[int] = 2
    in_projections: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj")
    examples: ClassVar[list[dict]] = [
        {"activation": "silu"},
        {"activation": "gelu", "hidden_dim": 40, "bias": True},
        {"activation": "gelu_tanh", "hidden_dim": 24},
        {"activation": "relu", "bias": True},
    ]

    @property
    def saved_hidden(self) -> int:
        # gate (the activation's input), act(gate) and up (the product's operands), the product
        # (the down projection's input); relu's saved output is act(gate) itself
        return 3 if self.activation == "relu" else 4


ExpertConfig = Annotated[Union[MLPConfig, GLUConfig], Field(discriminator="type")]


@register("ffn", "blocks.ffn:MoE")
class MoEConfig(FFNBlock):
    """Mixture of experts: a linear router picks top_k experts per token (Mixtral).

    Gates are the softmax over the chosen experts' logits; tokens go only to their experts.
    """

    type: Literal["moe"] = "moe"
    n_experts: int = Field(..., ge=1, description="Number of expert FFNs.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to; at most n_experts.")
    expert: ExpertConfig = Field(..., description="Each expert: an mlp or glu block.")

    examples: ClassVar[list[dict]] = [
        {"n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 48}},
        {"n_experts": 3, "top_k": 1, "expert": {"type": "mlp", "activation": "gelu", "bias": True}},
        {"n_experts": 2, "top_k": 2, "expert": {"type": "mlp", "activation": "relu", "hidden_dim": 16}},
    ]

    @model_validator(mode="after")
    def _top_k(self):
        if self.top_k > self.n_experts:
            raise rule_error(("top_k",), f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        return self

    def describe(self) -> str:
        return f"moe {self.n_experts}x{self.expert.type} top{self.top_k}"

    def params(self, d_model: int) -> int:
        return d_model * self.n_experts + self.n_experts * self.expert.params(d_model)

    def active_params(self, d_model: int) -> int:
        return d_model * self.n_experts + self.top_k * self.expert.params(d_model)

    def param_shapes(self, d_model: int) -> Shapes:
        # under tensor parallelism the router and the experts are replicated (no plan)
        shapes = {"router.weight": (self.n_experts, d_model)}
        expert = self.expert.param_shapes(d_model)
        for i in range(self.n_experts):
            shapes.update({f"experts.{i}.{name}": shape for name, shape in expert.items()})
        return shapes

    def flops(self, d_model: int, tokens: int) -> int:
        # Every token meets the router; each expert multiplies only the tokens sent to it,
        # tokens * top_k rows in all, whatever the routing.
        return 2 * tokens * d_model * self.n_experts + self.top_k * self.expert.flops(d_model, tokens)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see builder.memory). The router: its input, the fp32
        probabilities, the top_k fp32 values and int64 choices, their sum. Each of the
        tokens * top_k routed rows: the expert's own tensors (its gathered input among them),
        its output and the gated output, the gate, two int64 indices (sort order, token)."""
        routed = tokens * self.top_k
        router = tokens * (d_model * act_bytes + self.n_experts * 4 + self.top_k * (4 + 8) + 4)
        experts = self.expert.saved_bytes(d_model, routed, act_bytes)
        return router + experts + routed * (2 * d_model * act_bytes + act_bytes + 2 * 8)
