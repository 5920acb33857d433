"""Feed-forward configs: MLP, gated linear units (SwiGLU, GeGLU) and mixture of experts."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from yamlformer.blocks.configs.base import Classes, FFNBlock, Problems, Shapes, indivisible, rule_error
from yamlformer.blocks.configs.linear import LinearLayer
from yamlformer.blocks.configs.tensors import hidden, output, prefixed, vector
from yamlformer.blocks.configs.traffic import Traffic, activation, routing
from yamlformer.blocks.limits import MAX_EXPERTS, MAX_FACTOR, MAX_WIDTH
from yamlformer.blocks.registry import register

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]


class _DenseFFNConfig(FFNBlock):
    hidden_dim: int | None = Field(None, ge=1, le=MAX_WIDTH, description="Inner width; defaults to 4 * d_model.")
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

    def tensor_classes(self, d_model: int) -> Classes:
        classes: Classes = {}
        for name in self.in_projections:
            classes[f"{name}.weight"], classes[f"{name}.bias"] = hidden("d_model", "ffn"), vector("ffn")
        classes["down_proj.weight"], classes["down_proj.bias"] = hidden("ffn", "d_model"), vector()
        return {name: classes[name] for name in self.param_shapes(d_model)}

    def parallel_plan(self) -> dict[str, str]:
        # Megatron's MLP: the hidden width split, down_proj sums the ranks' parts
        return {**dict.fromkeys(self.in_projections, "colwise"), "down_proj": "rowwise"}

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        return indivisible(degree, hidden_dim=self.resolved_hidden_dim(d_model))

    def tensor_parallel(self, degree: int, d_model: int) -> _DenseFFNConfig:
        """``hidden_dim / degree`` of the hidden width."""
        return self.model_copy(update={"hidden_dim": self.resolved_hidden_dim(d_model) // degree})

    def flops(self, d_model: int, tokens: int) -> int:
        return 2 * tokens * (self.n_in_projections + 1) * d_model * self.resolved_hidden_dim(d_model)

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        # the activation over the hidden width (a GLU's product with the up projection too)
        return activation(self.resolved_hidden_dim(d_model), act_bytes, gated=self.n_in_projections == 2)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see yamlformer.builder.analysis.memory): the input and the hidden tensors."""
        return tokens * (d_model + self.saved_hidden * self.resolved_hidden_dim(d_model)) * act_bytes

    @property
    def saved_hidden(self) -> int:
        """Hidden-width tensors kept for backward per token."""
        raise NotImplementedError


@register("ffn", "yamlformer.blocks.ffn:MLP")
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


@register("ffn", "yamlformer.blocks.ffn:GLU")
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


ExpertConfig = Annotated[MLPConfig | GLUConfig, Field(discriminator="type")]


class ClampConfig(BaseModel):
    """GPT-OSS's clamped SwiGLU, on a glu expert's gate and up projections:
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``out = (up + 1) * gate * sigmoid(alpha * gate)``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    alpha: float = Field(
        ..., gt=0, le=MAX_FACTOR, description="The sigmoid's slope in gate * sigmoid(alpha * gate) (GPT-OSS: 1.702)."
    )
    limit: float = Field(
        ..., gt=0, le=MAX_FACTOR, description="Gate clamped above at limit, up to [-limit, limit] (GPT-OSS: 7.0)."
    )


def _experts_divide(n_experts: int, degree: int) -> Problems:
    """``n_experts`` named unless ``degree`` expert-parallel ranks split them evenly."""
    if n_experts % degree:
        return [(("n_experts",), f"{n_experts} is not a multiple of the expert-parallel degree {degree}")]
    return []


def _routed_linears(block: FFNBlock, shapes: Shapes, top_k: int) -> dict[str, LinearLayer]:
    """A mixture of experts' linear layers: the stacked experts, each token's rows meeting
    ``top_k`` of them, and any dense ones (shared experts); not the router, a plain ``nn.Linear``
    whose scores stay the base model's (``yamlformer.blocks.ffn``)."""
    return {
        module: dataclasses.replace(layer, rows=float(top_k)) if layer.stacked is not None else layer
        for module, layer in FFNBlock.linear_layers(block, shapes).items()
        if module != "router"
    }


@register("ffn", "yamlformer.blocks.ffn:MoE")
class MoEConfig(FFNBlock):
    """Mixture of experts: a linear router picks top_k experts per token (Mixtral, Qwen3-MoE
    with norm_topk_prob, GPT-OSS).

    Gates are the softmax over the chosen experts' logits (equal to a softmax over all of them,
    top-k and renormalised); tokens go only to their experts. GPT-OSS adds a router bias, biased
    experts and a clamped SwiGLU (``router_bias``, ``expert_bias``, ``clamp``).
    """

    type: Literal["moe"] = "moe"
    n_experts: int = Field(..., ge=1, le=MAX_EXPERTS, description="Number of expert FFNs.")
    top_k: int = Field(2, ge=1, le=MAX_EXPERTS, description="Experts each token is sent to; at most n_experts.")
    expert: ExpertConfig = Field(..., description="Each expert: an mlp or glu block.")
    router_bias: bool = Field(False, description="A bias on the router's logits, one per expert (GPT-OSS).")
    expert_bias: bool = Field(
        False,
        description="Biases on every expert's projections (GPT-OSS); true is the same as the expert's own bias: true.",
    )
    clamp: ClampConfig | None = Field(
        None,
        description="GPT-OSS's clamped SwiGLU on a glu expert with silu: gate = min(gate, limit), "
        "up = clamp(up, -limit, limit), out = (up + 1) * gate * sigmoid(alpha * gate); null: the "
        "expert's own GLU.",
    )

    examples: ClassVar[list[dict]] = [
        {"n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 48}},
        {"n_experts": 3, "top_k": 1, "expert": {"type": "mlp", "activation": "gelu", "bias": True}},
        {"n_experts": 2, "top_k": 2, "expert": {"type": "mlp", "activation": "relu", "hidden_dim": 16}},
        {
            "n_experts": 4,
            "top_k": 2,
            "expert": {"type": "glu", "hidden_dim": 24},
            "router_bias": True,
            "expert_bias": True,
            "clamp": {"alpha": 1.702, "limit": 7.0},
        },
        {"n_experts": 3, "top_k": 2, "expert": {"type": "mlp", "hidden_dim": 16}, "router_bias": True},
    ]

    @model_validator(mode="before")
    @classmethod
    def _expert_bias(cls, data):
        """``expert_bias: true`` is the expert's ``bias: true``, set there so every reader of the
        expert (counts, layouts, importers) sees it."""
        if not isinstance(data, dict) or data.get("expert_bias") is not True:
            return data
        expert = data.get("expert")
        if isinstance(expert, dict):
            if expert.get("bias") is False:
                raise rule_error(("expert_bias",), "expert_bias: true contradicts the expert's bias: false")
            return {**data, "expert": {**expert, "bias": True}}
        if isinstance(expert, BaseModel) and getattr(expert, "bias", None) is False:
            return {**data, "expert": expert.model_copy(update={"bias": True})}
        return data

    @model_validator(mode="after")
    def _top_k(self):
        if self.top_k > self.n_experts:
            raise rule_error(("top_k",), f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.clamp is not None and (self.expert.type != "glu" or self.expert.activation != "silu"):
            raise rule_error(
                ("clamp",),
                f"clamp is GPT-OSS's clamped SwiGLU: it needs a glu expert with activation silu, "
                f"got {self.expert.type} with {self.expert.activation}",
            )
        return self

    def describe(self) -> str:
        return f"moe {self.n_experts}x{self.expert.type} top{self.top_k}"

    def parallel_plan(self) -> dict[str, str] | None:
        # router (its bias too) and experts (their biases too) replicated under tensor parallelism
        return None

    def expert_parallel_plan(self) -> tuple[str, ...]:
        return ("experts",)  # the stacked experts; the router stays whole

    def linear_layers(self, shapes: Shapes) -> dict[str, LinearLayer]:
        return _routed_linears(self, shapes, self.top_k)

    def expert_parallel_problems(self, degree: int) -> Problems:
        return _experts_divide(self.n_experts, degree)

    def _router_params(self, d_model: int) -> int:
        return self.n_experts * (d_model + (1 if self.router_bias else 0))

    def params(self, d_model: int) -> int:
        return self._router_params(d_model) + self.n_experts * self.expert.params(d_model)

    def active_params(self, d_model: int) -> int:
        return self._router_params(d_model) + self.top_k * self.expert.params(d_model)

    def param_shapes(self, d_model: int) -> Shapes:
        # under tensor parallelism the router and the experts are replicated (no plan)
        shapes = {"router.weight": (self.n_experts, d_model)}
        if self.router_bias:
            shapes["router.bias"] = (self.n_experts,)
        # the experts stacked, one (n_experts, ...) tensor per projection (and bias)
        shapes.update(
            {f"experts.{name}": (self.n_experts, *shape) for name, shape in self.expert.param_shapes(d_model).items()}
        )
        return shapes

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        # the router's softmax and choice, each token's top_k rows gathered and combined, the experts' own
        expert = self.expert.traffic(d_model, act_bytes) * self.top_k
        return routing(d_model, act_bytes, self.n_experts, self.top_k) + expert

    def tensor_classes(self, d_model: int) -> Classes:
        # the router maps the width to a fixed number of scores: output-like
        classes: Classes = {"router.weight": output(), **prefixed("experts.", self.expert.tensor_classes(d_model))}
        if self.router_bias:
            classes["router.bias"] = vector(None)
        return classes

    def flops(self, d_model: int, tokens: int) -> int:
        # Every token meets the router; each expert multiplies only the tokens sent to it,
        # tokens * top_k rows in all, whatever the routing (biases and the clamp: no matmul).
        return 2 * tokens * d_model * self.n_experts + self.top_k * self.expert.flops(d_model, tokens)

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see yamlformer.builder.analysis.memory). The router: its input, the fp32
        probabilities, the top_k fp32 values and int64 choices, their sum. Each of the
        tokens * top_k routed rows: the expert's own tensors (its gathered input among them;
        a clamped SwiGLU's seven hidden ones: gate and up before and after their clamps,
        sigmoid(alpha * gate), the gated gate, their product), its output and the gated
        output, the gate, two int64 indices (sort order, token)."""
        routed = tokens * self.top_k
        router = tokens * (d_model * act_bytes + self.n_experts * 4 + self.top_k * (4 + 8) + 4)
        if self.clamp is not None:
            experts = routed * (d_model + 7 * self.expert.resolved_hidden_dim(d_model)) * act_bytes
        else:
            experts = self.expert.saved_bytes(d_model, routed, act_bytes)
        return router + experts + routed * (2 * d_model * act_bytes + act_bytes + 2 * 8)


@register("ffn", "yamlformer.blocks.ffn:DeepSeekMoE")
class DeepSeekMoEConfig(FFNBlock):
    """DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066; DeepSeek-V2 and V3): many fine-grained
    routed experts plus always-on shared experts, with DeepSeek's routing.

    Each token's router scores (``softmax`` in V2, ``sigmoid`` in V3) pick ``top_k`` experts,
    optionally only among the ``topk_groups`` best of ``n_groups`` expert groups; the chosen
    scores, renormalised when ``norm_topk_prob`` and times ``routed_scaling_factor``, weight the
    experts' outputs, and the shared experts' output is added. V3's auxiliary-loss-free
    balancing (``expert_bias``) adds a per-expert bias to the scores for the choice only and
    moves it by ``bias_update_speed`` after every optimizer step, against each expert's load.
    """

    type: Literal["deepseek_moe"] = "deepseek_moe"
    n_experts: int = Field(..., ge=1, le=MAX_EXPERTS, description="Number of routed experts.")
    top_k: int = Field(..., ge=1, le=MAX_EXPERTS, description="Routed experts each token is sent to.")
    n_shared_experts: int = Field(
        0,
        ge=0,
        le=MAX_EXPERTS,
        description="Experts every token passes through, built as one FFN of the expert's type with "
        "n_shared_experts times its hidden width (Hugging Face's shared_experts).",
    )
    expert: ExpertConfig = Field(..., description="Each routed expert: an mlp or glu block (fine-grained: narrow).")
    scoring: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router scores: softmax over the experts (V2) or a sigmoid per expert (V3)."
    )
    n_groups: int = Field(
        1, ge=1, le=MAX_EXPERTS, description="Groups the experts split into, in order (group-limited routing)."
    )
    topk_groups: int = Field(1, ge=1, le=MAX_EXPERTS, description="Groups a token may choose its experts from.")
    group_score: Literal["max", "top2_sum"] = Field(
        "max",
        description="How a group ranks: its best expert's score (V2's group_limited_greedy) or the sum "
        "of its two best, bias included (V3).",
    )
    norm_topk_prob: bool = Field(False, description="Renormalise the chosen experts' scores to sum to 1 (V3).")
    routed_scaling_factor: float = Field(
        1.0, gt=0, le=MAX_FACTOR, description="Multiplies the routed experts' weights (V2: 16, V2-Lite: 1, V3: 2.5)."
    )
    expert_bias: bool = Field(
        False,
        description="Auxiliary-loss-free balancing (V3): a per-expert bias, a buffer, added to the scores "
        "for choosing only, updated after each optimizer step.",
    )
    weight_on: Literal["output", "input"] = Field(
        "output",
        description="Where a routed expert's weight multiplies: its output (DeepSeek) or its input, "
        "the expert then run on weight * x (Llama 4).",
    )
    bias_update_speed: float = Field(
        0.001,
        ge=0,
        le=MAX_FACTOR,
        description="How far expert_bias moves after each optimizer step: +speed for an expert that got "
        "fewer tokens than the mean since the last step, -speed for one that got more (V3's gamma); "
        "0 freezes it.",
    )

    examples: ClassVar[list[dict]] = [
        {
            "n_experts": 6,
            "top_k": 2,
            "n_shared_experts": 2,
            "expert": {"type": "glu", "hidden_dim": 16},
            "n_groups": 3,
            "topk_groups": 2,
            "routed_scaling_factor": 2.0,
        },
        {
            "n_experts": 8,
            "top_k": 3,
            "n_shared_experts": 1,
            "expert": {"type": "glu", "hidden_dim": 12},
            "scoring": "sigmoid",
            "n_groups": 4,
            "topk_groups": 2,
            "group_score": "top2_sum",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "expert_bias": True,
        },
        {"n_experts": 4, "top_k": 1, "expert": {"type": "mlp", "activation": "gelu", "hidden_dim": 24, "bias": True}},
        {  # Llama 4: top-1, sigmoid, the weight on the expert's input, one shared expert
            "n_experts": 4,
            "top_k": 1,
            "n_shared_experts": 1,
            "expert": {"type": "glu", "hidden_dim": 16},
            "scoring": "sigmoid",
            "weight_on": "input",
        },
    ]

    @model_validator(mode="after")
    def _routing(self):
        if self.top_k > self.n_experts:
            raise rule_error(("top_k",), f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.n_experts % self.n_groups:
            raise rule_error(
                ("n_groups",), f"n_experts ({self.n_experts}) must be a multiple of n_groups ({self.n_groups})"
            )
        if self.topk_groups > self.n_groups:
            raise rule_error(
                ("topk_groups",), f"topk_groups ({self.topk_groups}) cannot exceed n_groups ({self.n_groups})"
            )
        reachable = self.topk_groups * (self.n_experts // self.n_groups)
        if self.top_k > reachable:
            raise rule_error(
                ("top_k",),
                f"top_k ({self.top_k}) exceeds the {reachable} experts of "
                f"{self.topk_groups} of {self.n_groups} groups; raise topk_groups",
            )
        if self.group_score == "top2_sum" and self.n_groups > 1 and self.n_experts // self.n_groups < 2:
            raise rule_error(("group_score",), "group_score top2_sum needs at least 2 experts per group")
        return self

    def shared(self, d_model: int):
        """The shared experts as one FFN (None without them): the expert, n_shared_experts wider."""
        if not self.n_shared_experts:
            return None
        hidden = self.n_shared_experts * self.expert.resolved_hidden_dim(d_model)
        return self.expert.model_copy(update={"hidden_dim": hidden})

    def describe(self) -> str:
        shared = f"+{self.n_shared_experts}s" if self.n_shared_experts else ""
        return f"dsmoe {self.n_experts}{shared}x{self.expert.type} top{self.top_k}"

    def expert_parallel_plan(self) -> tuple[str, ...]:
        return ("experts",)  # the stacked routed experts; router and shared experts stay whole

    def linear_layers(self, shapes: Shapes) -> dict[str, LinearLayer]:
        return _routed_linears(self, shapes, self.top_k)

    def expert_parallel_problems(self, degree: int) -> Problems:
        return _experts_divide(self.n_experts, degree)

    def params(self, d_model: int) -> int:
        shared = self.shared(d_model)
        return (
            d_model * self.n_experts
            + self.n_experts * self.expert.params(d_model)
            + (shared.params(d_model) if shared else 0)
        )

    def param_shapes(self, d_model: int) -> Shapes:
        # no plan: under tensor parallelism the router and every expert are replicated
        shapes: Shapes = {"router.weight": (self.n_experts, d_model)}
        shapes.update(
            {
                f"experts.{name}": (self.n_experts, *shape)  # stacked, one tensor per projection
                for name, shape in self.expert.param_shapes(d_model).items()
            }
        )
        shared = self.shared(d_model)
        if shared is not None:
            shapes.update({f"shared_experts.{name}": shape for name, shape in shared.param_shapes(d_model).items()})
        return shapes

    def tensor_classes(self, d_model: int) -> Classes:
        shared = self.shared(d_model)
        return {
            "router.weight": output(),
            **prefixed("experts.", self.expert.tensor_classes(d_model)),
            **(prefixed("shared_experts.", shared.tensor_classes(d_model)) if shared is not None else {}),
        }

    def active_params(self, d_model: int) -> int:
        shared = self.shared(d_model)
        return (
            d_model * self.n_experts
            + self.top_k * self.expert.params(d_model)
            + (shared.params(d_model) if shared else 0)
        )

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        # as MoE's, and every token through the shared experts
        shared = self.shared(d_model)
        routed = routing(d_model, act_bytes, self.n_experts, self.top_k)
        expert = self.expert.traffic(d_model, act_bytes) * self.top_k
        return routed + expert + (shared.traffic(d_model, act_bytes) if shared else Traffic())

    def flops(self, d_model: int, tokens: int) -> int:
        # the router on every token, tokens * top_k rows through the routed experts (whatever the
        # routing), every token through the shared experts
        shared = self.shared(d_model)
        return (
            2 * tokens * d_model * self.n_experts
            + self.top_k * self.expert.flops(d_model, tokens)
            + (shared.flops(d_model, tokens) if shared else 0)
        )

    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see yamlformer.builder.analysis.memory). The router (fp32, as DeepSeek and
        Hugging Face compute it): its input (and in a 16-bit dtype its fp32 copies of the input
        and the weight), the fp32 scores, the int64 choices, with ``norm_topk_prob`` the chosen
        scores and their sum, with sigmoid scores their per-token sum (the balancing loss).
        The routed rows as ``moe`` keeps them; the shared experts' tensors but their input
        (the router's, kept once)."""
        n, k, routed = self.n_experts, self.top_k, tokens * self.top_k
        router = tokens * (d_model * act_bytes + n * 4 + k * 8)
        if act_bytes != 4:
            router += tokens * d_model * 4 + n * d_model * 4
        if self.norm_topk_prob:
            router += tokens * (k * 4 + 4)
        if self.scoring == "sigmoid":
            router += tokens * 4
        experts = self.expert.saved_bytes(d_model, routed, act_bytes)
        experts += routed * (2 * d_model * act_bytes + act_bytes + 2 * 8)
        shared = self.shared(d_model)
        if shared is not None:
            experts += shared.saved_bytes(d_model, tokens, act_bytes) - tokens * d_model * act_bytes
        return router + experts
