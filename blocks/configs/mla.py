"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention: its config and counts.

Keys and values come from one low-rank latent per token: ``kv_a_proj_with_mqa`` maps the layer
input to ``kv_lora_rank + qk_rope_head_dim`` (the latent, then one rotary key shared by every
head), the latent is RMS-normalised and ``kv_b_proj`` expands it to each head's un-rotated key
(``qk_nope_head_dim``) and value (``v_head_dim``). Queries come through a low-rank pair with
its own norm (``q_lora_rank``; V2-Lite has none: one ``q_proj``) and split the same way. A score
is ``q_nope . k_nope + q_rope . k_rope``, so a head is ``qk_nope_head_dim + qk_rope_head_dim``
wide for the scores and ``v_head_dim`` wide for the mix.

Decoding caches the normalised latent and the rotated shared key only, ``kv_lora_rank +
qk_rope_head_dim`` numbers per token and layer (576 in V2/V3, against 2 x 128 heads x 128 for
the multi-head attention it replaces); ``yamlformer.blocks.mla`` absorbs ``kv_b_proj`` into the query and
the output instead of expanding the cache (DeepSeek's own inference code does the same).
The counts below are of one training forward, which expands the latent (see ``yamlformer.blocks.mla``).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field

from yamlformer.blocks.configs.base import (
    AttentionBlock,
    CacheLayout,
    CacheTensor,
    Classes,
    Problems,
    Shapes,
    indivisible,
)
from yamlformer.blocks.configs.norm import RMSNormConfig
from yamlformer.blocks.configs.pairs import kernel_saved_bytes
from yamlformer.blocks.configs.tensors import hidden, vector
from yamlformer.blocks.limits import MAX_FACTOR, MAX_HEADS, MAX_WIDTH
from yamlformer.blocks.registry import register


@register("attention", "yamlformer.blocks.mla:MultiHeadLatentAttention")
class MLAConfig(AttentionBlock):
    """DeepSeek's multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1)."""

    type: Literal["mla"] = Field("mla", description="Multi-head latent attention (DeepSeek-V2/V3).")
    n_heads: int = Field(
        ..., ge=1, le=MAX_HEADS, description="Number of query heads (each also gets its own key and value)."
    )
    q_lora_rank: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="Width of the compressed query (q_a_proj, RMSNorm, q_b_proj); null: one full-rank "
        "q_proj (DeepSeek-V2-Lite).",
    )
    kv_lora_rank: int = Field(
        ...,
        ge=1,
        le=MAX_WIDTH,
        description="Width of the compressed key-value latent each token caches (512 in V2/V3).",
    )
    qk_nope_head_dim: int = Field(
        ..., ge=1, le=MAX_WIDTH, description="Per-head width of the query and key part without rotary positions."
    )
    qk_rope_head_dim: int = Field(
        ...,
        ge=2,
        le=MAX_WIDTH,
        description="Per-head width of the rotary query part, and of the one rotary key all heads share "
        "(cached beside the latent); the position block rotates this part only.",
    )
    v_head_dim: int = Field(
        ..., ge=1, le=MAX_WIDTH, description="Per-head width of the values (may differ from the key width)."
    )
    bias: bool = Field(
        False,
        description="Biases on the down-projections (q_a_proj, kv_a_proj_with_mqa) and the output "
        "projection (DeepSeek's attention_bias); the up-projections have none.",
    )
    norm_eps: float = Field(1e-6, gt=0, le=MAX_FACTOR, description="eps of the RMSNorms on the two latents.")
    scale: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="Score scale; null means 1/sqrt(qk_nope_head_dim + qk_rope_head_dim). A position's "
        "score factor (YaRN's mscale_all_dim) multiplies it.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the attention weights.")

    #: configs the registry-wide tests build, count, run and decode with (d_model 32)
    examples: ClassVar[list[dict]] = [
        {"n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
        {
            "n_heads": 4,
            "q_lora_rank": 24,
            "kv_lora_rank": 12,
            "qk_nope_head_dim": 6,
            "qk_rope_head_dim": 8,
            "v_head_dim": 10,
            "bias": True,
        },
        {
            "n_heads": 2,
            "q_lora_rank": 8,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 2,
            "v_head_dim": 4,
            "scale": 0.3,
            "norm_eps": 1e-5,
        },
    ]

    @property
    def qk_head_dim(self) -> int:
        """Width of a head in the scores: the un-rotated part and the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def latent_norm(self) -> RMSNormConfig:
        """The RMSNorm on each latent (its config: eps; counted as a norm block counts itself)."""
        return RMSNormConfig(eps=self.norm_eps)

    # -- the attention contract (yamlformer.blocks.configs.base.AttentionBlock) ----------------------------

    def query_heads(self) -> int:
        return self.n_heads

    def rotated_heads(self) -> int:
        return self.n_heads + 1  # every query head's rotary part and the one shared rotary key

    def rotary_head_dim(self, d_model: int) -> int:
        return self.qk_rope_head_dim

    def params(self, d_model: int) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes(d_model).values())

    def param_shapes(self, d_model: int) -> Shapes:
        h, qk, kv_a = self.n_heads, self.qk_head_dim, self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            shapes: Shapes = {"q_proj.weight": (h * qk, d_model)}
        else:
            r = self.q_lora_rank
            shapes = {
                "q_a_proj.weight": (r, d_model),
                **({"q_a_proj.bias": (r,)} if self.bias else {}),
                "q_a_layernorm.weight": (r,),
                "q_b_proj.weight": (h * qk, r),
            }
        shapes["kv_a_proj_with_mqa.weight"] = (kv_a, d_model)
        if self.bias:
            shapes["kv_a_proj_with_mqa.bias"] = (kv_a,)
        shapes["kv_a_layernorm.weight"] = (self.kv_lora_rank,)
        shapes["kv_b_proj.weight"] = (h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        shapes["out_proj.weight"] = (d_model, h * self.v_head_dim)
        if self.bias:
            shapes["out_proj.bias"] = (d_model,)
        return shapes

    def tensor_classes(self, d_model: int) -> Classes:
        # the latent ranks count as widths that grow with d_model; the norms and biases are vectors
        return {name: hidden() if len(shape) == 2 else vector() for name, shape in self.param_shapes(d_model).items()}

    def score_head_dim(self, d_model: int) -> int:
        return self.qk_head_dim

    def with_score_factor(self, factor: float, d_model: int) -> MLAConfig:
        scale = self.scale if self.scale is not None else self.qk_head_dim**-0.5
        return self.model_copy(update={"scale": scale * factor})

    def parallel_plan(self) -> dict[str, str]:
        # whole heads per rank: the up-projections split by head, out_proj sums the ranks'
        # outputs; the down-projections and their norms (the shared latent) stay whole
        return {"q_proj": "colwise", "q_b_proj": "colwise", "kv_b_proj": "colwise", "out_proj": "rowwise"}

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        return indivisible(degree, n_heads=self.n_heads)

    def tensor_parallel(self, degree: int, d_model: int) -> MLAConfig:
        """``n_heads / degree`` heads over the same (replicated) latent; the cache is the whole
        latent on every rank."""
        return self.model_copy(update={"n_heads": self.n_heads // degree})

    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        h, qk = self.n_heads, self.qk_head_dim
        if self.q_lora_rank is None:
            query = 2 * seq_q * d_model * h * qk
        else:
            query = 2 * seq_q * self.q_lora_rank * (d_model + h * qk)
        out = 2 * seq_q * h * self.v_head_dim * d_model
        if not kv_input:
            return query + out
        kv = 2 * seq_k * d_model * (self.kv_lora_rank + self.qk_rope_head_dim)  # the latent and rotary key
        kv += 2 * seq_k * self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)  # expanded
        return query + kv + out

    def pair_flops(self, d_model: int) -> int:
        return 2 * self.n_heads * (self.qk_head_dim + self.v_head_dim)  # Q.K^T and P.V

    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        # one tensor per token: the normalised latent, then the rotated shared key
        return CacheLayout((CacheTensor("latent", 1, self.kv_lora_rank + self.qk_rope_head_dim),))

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
        """What a training forward (``yamlformer.blocks.mla``, the latent expanded) keeps for backward: the
        layer input (every down-projection's), each latent's RMSNorm and its output (the
        up-projection's input), q and k after the rotary part joins them, v and the
        output-projection input. ``fused`` keeps v as the view of the whole ``kv_b_proj`` output
        it is, the kernel's output and its fp32 log-sum-exp; eager keeps v copied contiguous by
        the P.V product, the fp32 softmax and, cast or masked, the probabilities, as
        ``multi_head`` does. In fp32 the key latent's norm keeps the whole down-projection
        output (its input is a view of it)."""
        tokens = batch * seq_q
        h, qk, v = self.n_heads, self.qk_head_dim, self.v_head_dim
        norm = self.latent_norm()
        total = tokens * d_model * act_bytes  # the layer input
        if self.q_lora_rank is not None:
            total += norm.saved_bytes(self.q_lora_rank, tokens, act_bytes) + tokens * self.q_lora_rank * act_bytes
        total += norm.saved_bytes(self.kv_lora_rank, tokens, act_bytes) + tokens * self.kv_lora_rank * act_bytes
        if act_bytes == 4:
            total += tokens * self.qk_rope_head_dim * 4  # the rest of kv_a_proj_with_mqa's output
        total += 2 * tokens * h * qk * act_bytes  # q, k
        total += tokens * h * v * act_bytes  # the output projection's input
        if fused:
            total += tokens * h * (self.qk_nope_head_dim + v) * act_bytes  # kv_b_proj's output, v in it
        else:
            total += tokens * h * v * act_bytes  # v, a contiguous copy
        return total + kernel_saved_bytes(batch, h, seq_q, seq_k, v, act_bytes, fused, masked, dropout=self.dropout > 0)

    def problems(self, d_model: int, cross: bool) -> Problems:
        if cross:
            return [
                (
                    (),
                    "mla is a self-attention: its cache compresses the layer's own tokens; use "
                    "multi_head for cross-attention",
                )
            ]
        return []

    def describe(self) -> str:
        """``mla 16h kv512 q1536``."""
        query = f" q{self.q_lora_rank}" if self.q_lora_rank is not None else ""
        return f"mla {self.n_heads}h kv{self.kv_lora_rank}{query}"
