"""One layer of blocks, torch-free: :class:`LayerConfig`, a stack's layer resolved (after the
stack's ``overrides``, ``yamlformer.builder.spec.schema.StackSpec.layer``) with its exact counts, summed
from its blocks' own; and :class:`LayerBlocks`, the field a block holding layers of its own
declares (multi-token prediction's head), whose blocks are any registered ones."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from yamlformer.blocks.configs.base import (
    AttentionBlock,
    Classes,
    FFNBlock,
    NormBlock,
    PositionBlock,
    Shapes,
    nested_block,
    rule_error,
)
from yamlformer.blocks.configs.traffic import Traffic, dropout, residual


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """A layer's blocks. ``cross_attention`` is what a cross-attending stack's layer uses (the
    stack's ``cross_attention``, else its self-attention without ``not_inherited_by_cross``).

    The counts take ``cross_len`` (the memory's length) for a layer that cross-attends, None
    for one that does not; ``yamlformer.builder.analysis.estimates`` sums them per layer."""

    attention: AttentionBlock
    cross_attention: AttentionBlock | None
    ffn: FFNBlock
    norm: NormBlock
    dropout: float
    #: False: the sub-layers in sequence; True: each reads the layer's input and their outputs
    #: are summed (GPT-NeoX); "shared_norm": so, with one input norm for all (GPT-J, Falcon)
    parallel_residual: bool | str = False

    def sublayers(self, cross: bool) -> tuple[str, ...]:
        """The residual sub-layers in order; each gets ``norm.per_sublayer`` norms."""
        return ("attention", "cross_attention", "ffn") if cross else ("attention", "ffn")

    def norm_names(self, cross: bool) -> list[str]:
        """The layer module's norms (``yamlformer.blocks.layers``): one per sub-layer, two for sandwich;
        one, ``attention_norm``, for a shared_norm parallel layer."""
        if self.parallel_residual == "shared_norm":
            return ["attention_norm"]
        subs = self.sublayers(cross)
        names = [f"{sub}_norm" for sub in subs]
        return names + ([f"{sub}_post_norm" for sub in subs] if self.norm.placement == "sandwich" else [])

    def parallel_problem(self) -> str | None:
        """Why this layer's norm placement cannot run its sub-layers in parallel (None: it can)."""
        placement = self.norm.placement
        if self.parallel_residual == "shared_norm" and placement != "pre":
            return (
                "parallel_residual shared_norm feeds one input norm to every sub-layer: "
                f"it needs norm placement pre, got {placement}"
            )
        if self.parallel_residual is True and placement == "post":
            return (
                "parallel_residual needs a norm inside each branch (placement pre, sandwich or "
                "post_sublayer), got post: one norm after the summed residual"
            )
        return None

    def describe(self, cross: bool) -> str:
        """A short label: ``8h/4kv w4096 +cross glu rmsnorm``, with a placement other than pre
        (``rmsnorm post_sublayer``) and a parallel residual (``parallel``, ``parallel shared_norm``)."""
        norm = self.norm.describe() + ("" if self.norm.placement == "pre" else f" {self.norm.placement}")
        parallel = {False: "", True: " parallel"}.get(self.parallel_residual, f" parallel {self.parallel_residual}")
        return self.attention.describe() + (" +cross" if cross else "") + f" {self.ffn.describe()} {norm}{parallel}"

    # -- counts: the sums of the blocks' own -----------------------------------------------------

    def params(self, d_model: int, cross: bool = False) -> dict[str, int]:
        """Parameters by block: ``attention``, ``cross_attention`` (when ``cross``), ``ffn``, ``norm``."""
        params = {"attention": self.attention.params(d_model)}
        if cross:
            params["cross_attention"] = self.cross_attention.params(d_model)
        params["ffn"] = self.ffn.params(d_model)
        params["norm"] = len(self.norm_names(cross)) * self.norm.params(d_model)
        return params

    def active_params(self, d_model: int, cross: bool = False) -> int:
        """Parameters one token meets (the FFN's active share)."""
        params = self.params(d_model, cross)
        return sum(params.values()) - params["ffn"] + self.ffn.active_params(d_model)

    def param_shapes(self, d_model: int, cross: bool = False) -> Shapes:
        """Every tensor of the layer module, by its ``named_parameters()`` name within it."""
        shapes: Shapes = {}
        for sub in self.sublayers(cross):
            block = getattr(self, sub)
            shapes.update({f"{sub}.{name}": shape for name, shape in block.param_shapes(d_model).items()})
        for norm in self.norm_names(cross):
            shapes.update({f"{norm}.{name}": shape for name, shape in self.norm.param_shapes(d_model).items()})
        return shapes

    def tensor_classes(self, d_model: int, cross: bool = False) -> Classes | None:
        """Every tensor's class (``yamlformer.blocks.configs.tensors``), by :meth:`param_shapes` name; None
        when a block of the layer declares none."""
        classes: Classes = {}
        blocks = [(f"{sub}.", getattr(self, sub)) for sub in self.sublayers(cross)]
        blocks += [(f"{norm}.", self.norm) for norm in self.norm_names(cross)]
        for prefix, block in blocks:
            own = block.tensor_classes(d_model)
            if own is None:
                return None
            classes.update({prefix + name: cls for name, cls in own.items()})
        return classes

    def flops(self, d_model: int, tokens: int, cross_len: int | None = None) -> dict[str, int]:
        """Forward FLOPs of one sequence of ``tokens`` by block (norms: 0)."""
        flops = {"attention": self.attention.flops(d_model, tokens, tokens)}
        if cross_len is not None:
            flops["cross_attention"] = self.cross_attention.flops(d_model, tokens, cross_len)
        flops["ffn"] = self.ffn.flops(d_model, tokens)
        flops["norm"] = 0
        return flops

    def kernel_flops(self, d_model: int, tokens: int, causal: bool, cross_len: int | None = None) -> int:
        """Forward FLOPs with attention over the pairs a tiled kernel visits (MFU)."""
        kernel = self.attention.kernel_flops(d_model, tokens, tokens, causal)
        if cross_len is not None:
            kernel += self.cross_attention.kernel_flops(d_model, tokens, cross_len, causal=False)
        return kernel + self.ffn.flops(d_model, tokens)

    def saved_bytes(
        self,
        d_model: int,
        batch: int,
        tokens: int,
        act_bytes: int,
        fused: bool,
        causal: bool,
        position: PositionBlock,
        cross_len: int | None = None,
    ) -> int:
        """Bytes the layer keeps for backward over ``batch`` sequences of ``tokens``: its blocks'
        (self-attention with the position's per-layer share, cross-attention over a shared memory,
        FFN, norms) and one-byte dropout masks on each sub-layer's output."""
        attn, cross = self.attention, cross_len is not None
        masked = attn.masked(causal) or position.biases_scores  # eager attention adds a mask or bias
        saved = attn.saved_bytes(d_model, batch, tokens, tokens, act_bytes, fused, masked)
        saved += position.saved_bytes_per_layer(batch, tokens, attn.rotary_head_dim(d_model), act_bytes)
        if cross:
            saved += self.cross_attention.saved_bytes(
                d_model, batch, tokens, cross_len, act_bytes, fused, masked=False, kv_input=False
            )
        saved += self.ffn.saved_bytes(d_model, batch * tokens, act_bytes)
        saved += len(self.norm_names(cross)) * self.norm.saved_bytes(d_model, batch * tokens, act_bytes)
        if self.dropout > 0:
            saved += len(self.sublayers(cross)) * batch * tokens * d_model  # one-byte masks
        return saved - self._shared_saved_bytes(d_model, batch * tokens, act_bytes, cross)

    def traffic(self, d_model: int, act_bytes: int, position: PositionBlock, cross: bool = False) -> dict[str, Traffic]:
        """HBM bytes per token of the layer's memory-bound work (``yamlformer.blocks.configs.traffic``)
        by part: ``attention`` (around the kernels, cross-attention's too), ``position`` (the
        rotation the position block applies in the self-attention), ``ffn``, ``norms``, and
        ``residual`` (each sub-layer's residual add, and its dropout when the layer has one)."""
        attn, subs = self.attention, len(self.sublayers(cross))
        around = attn.traffic(d_model, act_bytes)
        if cross:
            around = around + self.cross_attention.traffic(d_model, act_bytes)
        adds = residual(d_model, act_bytes) * subs
        if self.dropout > 0:
            adds = adds + dropout(d_model, act_bytes) * subs
        return {
            "attention": around,
            "position": position.traffic_per_layer(attn.rotated_heads(), attn.rotary_head_dim(d_model), act_bytes),
            "ffn": self.ffn.traffic(d_model, act_bytes),
            "norms": self.norm.traffic(d_model, act_bytes) * len(self.norm_names(cross)),
            "residual": adds,
        }

    def _shared_saved_bytes(self, d_model: int, tokens: int, act_bytes: int, cross: bool) -> int:
        """What the blocks' own counts hold twice in a parallel layer, whose sub-layers read one
        input: with norms per sub-layer (pre, sandwich) what of the layer input each norm keeps
        as it is (``NormBlock.input_saved_bytes``); with no input norm (post_sublayer) or a shared
        one, the sub-layers' input, which every sub-layer keeps (its first projections')."""
        if not self.parallel_residual:
            return 0
        others = len(self.sublayers(cross)) - 1  # the sub-layers that read what the first keeps too
        if self.parallel_residual == "shared_norm" or self.norm.placement == "post_sublayer":
            return others * tokens * d_model * act_bytes
        return others * self.norm.input_saved_bytes(d_model, tokens, act_bytes)


class LayerBlocks(BaseModel):
    """The blocks of a layer another block runs itself (a multi-token-prediction head's): a
    causal self-attention layer, its norms placed as ``norm.placement`` says. In a spec it is
    merged over its stack's own blocks before validation, as a layer override is."""

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    attention: nested_block("attention", "The layer's self-attention.")
    ffn: nested_block("ffn", "The layer's feed-forward block.") = Field(default_factory=lambda: {"type": "mlp"})
    norm: nested_block("norm", "The layer's norm block and its placement.") = Field(
        default_factory=lambda: {"type": "layernorm"}
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="On each sub-layer's output.")
    parallel_residual: bool | Literal["shared_norm"] = Field(
        False,
        description="As a stack's: true runs attention and the FFN on the layer's input and adds both "
        "(GPT-NeoX); shared_norm feeds them one norm (GPT-J, Falcon). Its stack's value when left out.",
    )

    @model_validator(mode="after")
    def _parallel(self):
        problem = self.layer().parallel_problem()
        if problem:
            raise rule_error(("parallel_residual",), problem)
        return self

    def layer(self) -> LayerConfig:
        return LayerConfig(self.attention, None, self.ffn, self.norm, self.dropout, self.parallel_residual)
