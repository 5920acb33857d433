"""Multi-token prediction (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437,
section 2.2) as a head: its config and exact counts; the module is ``yamlformer.blocks.mtp``.

The head projects the final hidden states to the vocabulary (the main prediction, which decoding
uses alone) and, on a forward without a KV cache, runs ``num_nextn_predict_layers`` (D) chained
modules: module ``k`` takes ``h^(k-1)`` (``h^0``: the head's input) and the shared embedding of
the token ``k`` places on, ``h'_t = eh_proj([enorm(emb(x_(t+k))); hnorm(h^(k-1)_t)])``, runs one
causal Transformer layer of its own over it (``h^k``) and predicts token ``t + k + 1`` with the
shared projection after its own norm (Hugging Face: ``shared_head.norm``). The loss it returns is
``loss_weight / D`` times the sum of the modules' cross-entropies over the positions whose target
lies inside the window (and in the same packed document, not padding).

Each module's layer is ``layer``; in a spec it is merged over its stack's own blocks (the layers'
blocks before ``overrides``): DeepSeek-V3's is one of its MoE layers. Its three norms are that
layer's norm block.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field, WithJsonSchema, model_validator

from yamlformer.blocks.configs.base import Classes, HeadBlock, PositionBlock, Shapes, loss_saved_bytes, rule_error
from yamlformer.blocks.configs.layer import LayerBlocks
from yamlformer.blocks.configs.linear import LinearLayer
from yamlformer.blocks.configs.tensors import hidden, prefixed, vocab_classes
from yamlformer.blocks.limits import MAX_FACTOR, MAX_LAYERS
from yamlformer.blocks.registry import register

#: a spec may give part of the layer (the rest is its stack's), so every key is optional here
_PARTIAL_LAYER = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "attention": {"type": "object"},
                "ffn": {"type": "object"},
                "norm": {"type": "object"},
                "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            },
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}
_TINY = {
    "attention": {"type": "multi_head", "n_heads": 4},
    "ffn": {"type": "glu", "hidden_dim": 48},
    "norm": {"type": "rmsnorm"},
}


@register("head", "yamlformer.blocks.mtp:MultiTokenPredictionHead")
class MTPHeadConfig(HeadBlock):
    """A language-model head with DeepSeek-V3's multi-token prediction modules (module doc)."""

    projects_to_vocab: ClassVar[bool] = True
    layer_field: ClassVar[str | None] = "layer"
    type: Literal["mtp"] = Field("mtp", description="LM head plus multi-token prediction (DeepSeek-V3).")
    num_nextn_predict_layers: int = Field(
        1,
        ge=1,
        le=MAX_LAYERS,
        description="D: chained modules, module k predicting the token k + 1 ahead (Hugging Face's name; V3: 1).",
    )
    loss_weight: float = Field(
        0.3,
        ge=0,
        le=MAX_FACTOR,
        description="lambda: the loss adds lambda / D times the sum of the modules' cross-entropies "
        "(DeepSeek-V3: 0.3 for the first 10T tokens, 0.1 after).",
    )
    layer: Annotated[LayerBlocks | None, WithJsonSchema(_PARTIAL_LAYER)] = Field(
        None,
        description="Each module's Transformer layer (attention, ffn, norm, dropout); in a spec, merged over "
        "the stack's own blocks, as a layer override is. Its norm block is also the modules' three norms.",
    )

    examples: ClassVar[list[dict]] = [
        {"layer": _TINY},
        {
            "num_nextn_predict_layers": 2,
            "loss_weight": 0.1,
            "layer": {
                "attention": {
                    "type": "mla",
                    "n_heads": 2,
                    "q_lora_rank": 8,
                    "kv_lora_rank": 8,
                    "qk_nope_head_dim": 4,
                    "qk_rope_head_dim": 2,
                    "v_head_dim": 4,
                },
                "ffn": {
                    "type": "deepseek_moe",
                    "n_experts": 4,
                    "top_k": 2,
                    "n_shared_experts": 1,
                    "expert": {"type": "glu", "hidden_dim": 8},
                },
                "norm": {"type": "rmsnorm", "eps": 1e-6},
            },
        },
        {"layer": {**_TINY, "norm": {"type": "layernorm", "placement": "post"}, "dropout": 0.1}},
    ]

    @model_validator(mode="after")
    def _needs_a_layer(self):
        if self.layer is None:
            raise rule_error(
                ("layer",),
                "the multi-token-prediction head needs its modules' layer: in a spec it is the "
                "stack's own blocks; on its own, give `layer:` (attention, ffn, norm)",
            )
        return self

    def describe(self) -> str:
        return f"mtp x{self.num_nextn_predict_layers} ({self.layer.layer().describe(cross=False)})"

    # -- the head contract (yamlformer.blocks.configs.base.HeadBlock) ----------------------------------------

    def params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes(d_model, vocab_size, tied).values())

    def active_params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        layer = self.layer.layer()
        inactive = sum(layer.params(d_model).values()) - layer.active_params(d_model)
        return self.params(d_model, vocab_size, tied) - self.num_nextn_predict_layers * inactive

    def auxiliary(self, d_model: int, vocab_size: int, tied: bool, tokens: int) -> dict[str, tuple[int, int]]:
        """The modules (``mtp.*``) and their predictions through the shared projection: all but the
        main prediction, which decoding runs alone."""
        shapes = self.param_shapes(d_model, vocab_size, tied)
        params = sum(math.prod(shape) for name, shape in shapes.items() if name.startswith("mtp."))
        main = 2 * tokens * d_model * vocab_size
        return {"mtp": (params, self.flops(d_model, vocab_size, tokens) - main)}

    def param_shapes(self, d_model: int, vocab_size: int, tied: bool) -> Shapes:
        layer, norm = self.layer.layer(), self.layer.norm.param_shapes(d_model)
        shapes: Shapes = {} if tied else {"proj.weight": (vocab_size, d_model)}
        for k in range(self.num_nextn_predict_layers):
            at = f"mtp.{k}."
            shapes.update({f"{at}enorm.{name}": shape for name, shape in norm.items()})
            shapes.update({f"{at}hnorm.{name}": shape for name, shape in norm.items()})
            shapes[f"{at}eh_proj.weight"] = (d_model, 2 * d_model)
            shapes.update({f"{at}layer.{name}": shape for name, shape in layer.param_shapes(d_model).items()})
            shapes.update({f"{at}norm.{name}": shape for name, shape in norm.items()})
        return shapes

    def linear_layers(self, shapes: Shapes) -> dict[str, LinearLayer]:
        """The projection, each module's ``eh_proj`` and its layer's blocks' own linear layers
        (a mixture of experts' router left out, as its block says)."""
        layer = self.layer.layer()
        out = {m: entry for m, entry in super().linear_layers(shapes).items() if ".layer." not in f".{m}"}
        for k in range(self.num_nextn_predict_layers):
            for sub in layer.sublayers(cross=False):
                prefix = f"mtp.{k}.layer.{sub}."
                own = {n.removeprefix(prefix): s for n, s in shapes.items() if n.startswith(prefix)}
                out.update({prefix + m: entry for m, entry in getattr(layer, sub).linear_layers(own).items()})
        return out

    def tensor_classes(self, d_model: int, vocab_size: int, tied: bool) -> Classes | None:
        layer, norm = self.layer.layer().tensor_classes(d_model), self.layer.norm.tensor_classes(d_model)
        if layer is None or norm is None:
            return None  # a block of its layer declares none
        classes = vocab_classes("proj", bias=False)
        for k in range(self.num_nextn_predict_layers):
            at = f"mtp.{k}."
            for name in ("enorm", "hnorm", "norm"):
                classes.update(prefixed(f"{at}{name}.", norm))
            classes[f"{at}eh_proj.weight"] = hidden()
            classes.update(prefixed(f"{at}layer.", layer))
        return classes

    def parallel_plan(self) -> dict[str, str]:
        # vocab-parallel logits, as lm; the modules stay whole on every rank (their inputs do)
        return {"proj": "colwise"}

    def flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        module = 2 * tokens * 2 * d_model * d_model + sum(self.layer.layer().flops(d_model, tokens).values())
        return self._projections(d_model, vocab_size, tokens) + self.num_nextn_predict_layers * module

    def kernel_flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        module = 2 * tokens * 2 * d_model * d_model + self.layer.layer().kernel_flops(d_model, tokens, causal=True)
        return self._projections(d_model, vocab_size, tokens) + self.num_nextn_predict_layers * module

    def _projections(self, d_model: int, vocab_size: int, tokens: int) -> int:
        """The main prediction and each module's, through the one projection."""
        return (1 + self.num_nextn_predict_layers) * 2 * tokens * d_model * vocab_size

    def saved_bytes(
        self,
        d_model: int,
        vocab_size: int,
        tokens: int,
        act_bytes: int,
        *,
        batch: int = 1,
        fused: bool = True,
        position: PositionBlock | None = None,
        compiled_loss: bool = False,
    ) -> int:
        """As ``lm`` for the main prediction (the projection input, the logits the caller holds,
        the loss's fp32 log-probabilities); per module: the shifted ids (int64) its embedding
        lookup keeps, its two input norms, the ``eh_proj`` input, its layer (as a stack's),
        its own norm, the projection input, the fp32 log-probabilities and the int64 targets of
        its loss. In fp32 ``hnorm``'s input is a tensor kept already (the main projection's
        input, then the previous module's norm input)."""
        d, norm = d_model, self.layer.norm
        loss = loss_saved_bytes(tokens, vocab_size, compiled_loss)
        main = tokens * d * act_bytes + tokens * vocab_size * act_bytes + loss
        module = tokens * 8  # the shifted ids
        module += 3 * norm.saved_bytes(d, tokens, act_bytes) - (tokens * d * 4 if act_bytes == 4 else 0)
        module += tokens * 2 * d * act_bytes  # eh_proj's input
        layer = self.layer.layer()
        seq = tokens // batch
        module += layer.saved_bytes(d, batch, seq, act_bytes, fused, True, position or PositionBlock())
        module += tokens * d * act_bytes + loss + tokens * 8  # the module's prediction and loss
        return main + self.num_nextn_predict_layers * module
