"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv:2410.05258): its
config and exact counts; the module is ``yamlformer.blocks.differential``.

Each of ``n_heads`` heads splits its query and key into two halves of ``head_dim`` and takes
the difference of their two softmax maps, ``softmax(Q1 K1^T) - lambda * softmax(Q2 K2^T)``, over
one value ``2 * head_dim`` wide; ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` from
four learned ``head_dim`` vectors shared by the layer's heads, ``lambda_init = 0.8 - 0.6 *
exp(-0.3 * layer_index)`` (the paper's depth rule, layers counted from 0) unless set. Each head's
output is RMS-normalised over its ``2 * head_dim`` (one weight for all heads: the paper's
GroupNorm) and scaled by ``1 - lambda_init``. Keys and values may be grouped (GQA).

The module computes the two maps as two attention calls over the same values (FlashAttention
runs them as it runs any head; the paper's fused kernel does the same), so the mix is counted
twice: a (query, key) pair costs ``n_heads * (2 * 2 * head_dim + 2 * 2 * 2 * head_dim)`` FLOPs.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.blocks.configs.base import (
    AttentionBlock,
    CacheLayout,
    CacheTensor,
    Classes,
    Problems,
    Shapes,
    indivisible,
    rule_error,
)
from yamlformer.blocks.configs.norm import RMSNormConfig
from yamlformer.blocks.configs.pairs import kernel_saved_bytes
from yamlformer.blocks.configs.tensors import hidden, vector
from yamlformer.blocks.limits import MAX_FACTOR, MAX_HEADS, MAX_SEQ_LEN, MAX_WIDTH
from yamlformer.blocks.registry import register

#: the learned lambda vectors (module parameters, each ``(head_dim,)``)
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def depth_lambda_init(layer_index: int) -> float:
    """The paper's ``lambda_init`` at a layer (0-based, as its code counts depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@register("attention", "yamlformer.blocks.differential:DifferentialAttention")
class DifferentialAttentionConfig(AttentionBlock):
    """Differential attention: two softmax maps per head, subtracted (module doc)."""

    type: Literal["differential"] = Field("differential", description="Differential attention (Ye et al. 2024).")
    n_heads: int = Field(
        ..., ge=1, le=MAX_HEADS, description="Differential heads; each has two query/key halves and one value."
    )
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        le=MAX_HEADS,
        description="Key/value heads (defaults to n_heads); fewer is grouped-query. n_heads must be a multiple.",
    )
    head_dim: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="Width of each query/key half; a value is twice as wide. Defaults to d_model / (2 * n_heads).",
    )
    lambda_init: float | None = Field(
        None,
        ge=0,
        le=MAX_FACTOR,
        description="lambda's constant part; null: 0.8 - 0.6 * exp(-0.3 * layer_index), the paper's depth rule.",
    )
    norm_eps: float = Field(1e-5, gt=0, le=MAX_FACTOR, description="eps of the per-head RMS norm.")
    sliding_window: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="A window w: query i sees key j only where i - j < w, itself included. null: no window.",
    )
    scale: float | None = Field(
        None, gt=0, le=MAX_FACTOR, description="Score scale of both maps; null means 1/sqrt(head_dim)."
    )

    #: configs the registry-wide tests build, count, run and decode with (d_model 32)
    examples: ClassVar[list[dict]] = [
        {"n_heads": 2},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 6},
        {"n_heads": 2, "n_kv_heads": 1, "lambda_init": 0.5, "sliding_window": 3, "norm_eps": 1e-6},
    ]

    @model_validator(mode="after")
    def _heads(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        elif self.n_heads % self.n_kv_heads:
            raise rule_error(
                ("n_kv_heads",), f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        return self

    def resolved_head_dim(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // (2 * self.n_heads)

    def resolved_lambda_init(self, layer_index: int) -> float:
        return self.lambda_init if self.lambda_init is not None else depth_lambda_init(layer_index)

    def head_norm(self) -> RMSNormConfig:
        """The per-head norm, counted as an RMSNorm over ``2 * head_dim``."""
        return RMSNormConfig(eps=self.norm_eps)

    # -- the attention contract (yamlformer.blocks.configs.base.AttentionBlock) ----------------------------

    def query_heads(self) -> int:
        return self.n_heads

    def rotary_head_dim(self, d_model: int) -> int:
        return self.resolved_head_dim(d_model)  # each half rotates as a head of its own

    def window(self) -> int | None:
        return self.sliding_window

    def params(self, d_model: int) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes(d_model).values())

    def param_shapes(self, d_model: int) -> Shapes:
        hd = self.resolved_head_dim(d_model)
        q, kv = 2 * self.n_heads * hd, 2 * self.n_kv_heads * hd
        return {
            "q_proj.weight": (q, d_model),
            "k_proj.weight": (kv, d_model),
            "v_proj.weight": (kv, d_model),
            "out_proj.weight": (d_model, q),
            **dict.fromkeys(LAMBDAS, (hd,)),
            "subln.weight": (2 * hd,),
        }

    def tensor_classes(self, d_model: int) -> Classes:
        projections = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")
        return {name: hidden() if name in projections else vector("head") for name in self.param_shapes(d_model)}

    def score_head_dim(self, d_model: int) -> int:
        return self.resolved_head_dim(d_model)

    def with_score_factor(self, factor: float, d_model: int) -> DifferentialAttentionConfig:
        scale = self.scale if self.scale is not None else self.resolved_head_dim(d_model) ** -0.5
        return self.model_copy(update={"scale": scale * factor})

    def parallel_plan(self) -> dict[str, str]:
        # whole heads per rank, as multi_head; lambda and the norm weight, shared by the heads,
        # stay whole and the module sums their gradients over the ranks (yamlformer.blocks.differential)
        return {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise"}

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        kv = {"n_kv_heads": self.n_kv_heads} if self.n_kv_heads != self.n_heads else {}
        return indivisible(degree, n_heads=self.n_heads, **kv)

    def tensor_parallel(self, degree: int, d_model: int) -> DifferentialAttentionConfig:
        return self.model_copy(
            update={
                "n_heads": self.n_heads // degree,
                "n_kv_heads": self.n_kv_heads // degree,
                "head_dim": self.resolved_head_dim(d_model),
            }
        )

    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        hd = self.resolved_head_dim(d_model)
        flops = 2 * seq_q * d_model * 2 * self.n_heads * hd * 2  # query in, output out
        if kv_input:
            flops += 2 * seq_k * d_model * 2 * self.n_kv_heads * hd * 2  # key and value
        return flops

    def pair_flops(self, d_model: int) -> int:
        hd = self.resolved_head_dim(d_model)
        return self.n_heads * 2 * (2 * hd + 2 * 2 * hd)  # two maps: Q.K^T (hd) and P.V (2 hd) each

    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        # both key halves as 2 * n_kv_heads heads of head_dim; values 2 * head_dim wide
        hd = self.resolved_head_dim(d_model)
        tensors = (CacheTensor("k", 2 * self.n_kv_heads, hd), CacheTensor("v", self.n_kv_heads, 2 * hd))
        return CacheLayout(tensors, window=self.sliding_window)

    def saved_bytes(
        self,
        d_model: int,
        batch: int,
        seq_q: int,
        seq_k: int,
        act_bytes: int,
        fused: bool,
        masked: bool,
        kv_input: bool = True,
    ) -> int:
        """The layer input, q and k (both halves, rotated), v, each map's kernel state (twice
        what ``multi_head`` keeps), the second map's output (lambda's operand), the per-head
        norm's and the output-projection input. Eager attention keeps the keys and values
        repeated to n_heads when grouped, once per map (values shared by the two maps once)."""
        hd, n = self.resolved_head_dim(d_model), self.n_heads
        tq, tk = batch * seq_q, batch * seq_k
        grouped = self.n_kv_heads != n
        total = tq * d_model * act_bytes  # the projections' input
        total += 2 * tq * 2 * n * hd * act_bytes  # q (both halves); the output-projection input
        total += tk * 2 * (self.n_kv_heads if fused else n) * hd * act_bytes  # k (both halves)
        values = self.n_kv_heads if fused else n * (2 if grouped else 1)  # eager: repeated per map
        total += tk * values * 2 * hd * act_bytes
        if not fused:
            total += tq * n * 2 * hd * act_bytes  # the second map's output (a fused kernel keeps it)
        total += self.head_norm().saved_bytes(2 * hd, tq * n, act_bytes)
        return total + 2 * kernel_saved_bytes(batch, n, seq_q, seq_k, 2 * hd, act_bytes, fused, masked)

    def problems(self, d_model: int, cross: bool) -> Problems:
        if cross:
            return [((), "differential is a self-attention; use multi_head for cross-attention")]
        if self.head_dim is None and d_model % (2 * self.n_heads):
            return [
                (
                    ("n_heads",),
                    f"d_model ({d_model}) is not a multiple of 2 * n_heads ({2 * self.n_heads}); set head_dim",
                )
            ]
        return []

    def describe(self) -> str:
        """``diff 8h/4kv w4096``."""
        heads = f"{self.n_heads}h" + (f"/{self.n_kv_heads}kv" if self.n_kv_heads != self.n_heads else "")
        return "diff " + heads + (f" w{self.sliding_window}" if self.sliding_window else "")
