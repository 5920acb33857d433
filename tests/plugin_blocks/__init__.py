"""Blocks from outside the package, registered through ``--plugin plugin_blocks``: the proof that
the block contracts (``yamlformer.blocks.configs.base``) are all generic code needs.

* ``lowrank_kv`` attention: keys and values come from one low-rank latent per token shared by the
  heads, plus one rotary key shared by the heads (the shape of DeepSeek's multi-head latent
  attention, without its norms and query compression). Decoding caches only the latent and the
  rotary key; value heads are wider or narrower than query/key heads.
* ``interleaved_rope`` position: rotary embedding on interleaved pairs ``(x0, x1), (x2, x3)...``
  (GPT-J; DeepSeek-V3's ``rope_interleave``), acting on whatever part of each head an attention
  block hands it.

Configs are here (torch-free, as ``builder validate`` needs); the modules in ``.modules``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from yamlformer.blocks.configs.base import (
    AttentionBlock,
    CacheLayout,
    CacheTensor,
    Loc,
    PositionBlock,
    Problems,
    Shapes,
)
from yamlformer.blocks.registry import register


@register("attention", "plugin_blocks.modules:LowRankKVAttention")
class LowRankKVConfig(AttentionBlock):
    """Attention over keys and values expanded from a cached low-rank latent."""

    type: Literal["lowrank_kv"] = "lowrank_kv"
    n_heads: int = Field(..., ge=1, description="Query heads (keys and values have as many).")
    kv_rank: int = Field(..., ge=1, description="Width of the latent each token's keys and values come from.")
    head_dim: int = Field(..., ge=1, description="Per-head query/key width without position.")
    rope_dim: int = Field(
        ..., ge=2, description="Per-head query/key width that rotates (one key part shared by heads)."
    )
    v_head_dim: int = Field(..., ge=1, description="Per-head value width.")

    examples: ClassVar[list[dict]] = [
        {"n_heads": 4, "kv_rank": 12, "head_dim": 6, "rope_dim": 4, "v_head_dim": 10},
        {"n_heads": 2, "kv_rank": 8, "head_dim": 8, "rope_dim": 2, "v_head_dim": 8},
    ]

    def query_heads(self) -> int:
        return self.n_heads

    def rotary_head_dim(self, d_model: int) -> int:
        return self.rope_dim

    def params(self, d_model: int) -> int:
        n, qk = self.n_heads, self.head_dim + self.rope_dim
        return (
            d_model * n * qk  # q_proj
            + d_model * (self.kv_rank + self.rope_dim)  # kv_down: the latent and the rotary key
            + self.kv_rank * n * (self.head_dim + self.v_head_dim)  # kv_up
            + n * self.v_head_dim * d_model
        )  # out_proj

    def param_shapes(self, d_model: int) -> Shapes:
        n, qk = self.n_heads, self.head_dim + self.rope_dim
        return {
            "q_proj.weight": (n * qk, d_model),
            "kv_down.weight": (self.kv_rank + self.rope_dim, d_model),
            "kv_up.weight": (n * (self.head_dim + self.v_head_dim), self.kv_rank),
            "out_proj.weight": (d_model, n * self.v_head_dim),
        }

    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        n, qk = self.n_heads, self.head_dim + self.rope_dim
        flops = 2 * seq_q * d_model * n * qk + 2 * seq_q * n * self.v_head_dim * d_model
        # kv_up expands the latent of every key position (cached or not) in each forward
        flops += 2 * seq_k * self.kv_rank * n * (self.head_dim + self.v_head_dim)
        if kv_input:
            flops += 2 * seq_k * d_model * (self.kv_rank + self.rope_dim)
        return flops

    def pair_flops(self, d_model: int) -> int:
        return 2 * self.n_heads * (self.head_dim + self.rope_dim + self.v_head_dim)  # Q.K^T and P.V

    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        return CacheLayout((CacheTensor("latent", 1, self.kv_rank), CacheTensor("k_rope", 1, self.rope_dim)))

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
        n, qk, v = self.n_heads, self.head_dim + self.rope_dim, self.v_head_dim
        tq, tk = batch * seq_q, batch * seq_k
        total = tq * d_model * act_bytes  # the projections' input
        total += tk * self.kv_rank * act_bytes  # kv_up's input (the latent)
        total += tq * n * qk * act_bytes + tk * n * (qk + v) * act_bytes  # q, k (concatenated), v
        total += tq * n * v * act_bytes  # out_proj's input
        pairs = batch * n * seq_q * seq_k
        if fused:
            return total + tq * n * v * act_bytes + batch * n * seq_q * 4  # kernel output, fp32 log-sum-exp
        total += pairs * 4  # fp32 softmax
        if act_bytes != 4 or masked:
            total += pairs * act_bytes  # probabilities cast (or masked) for P.V
        return total

    def problems(self, d_model: int, cross: bool) -> Problems:
        if cross:
            return [((), "lowrank_kv attends over its own stack's tokens; it cannot be a cross-attention")]
        return []


@register("position", "plugin_blocks.modules:InterleavedRope")
class InterleavedRopeConfig(PositionBlock):
    """Rotary embedding on interleaved pairs of the rotary part of each query and key head."""

    type: Literal["interleaved_rope"] = "interleaved_rope"
    theta: float = Field(10000.0, gt=0, description="The base of the rotation frequencies.")

    examples: ClassVar[list[dict]] = [{}, {"theta": 500.0}]

    def saved_bytes_per_layer(self, batch: int, seq: int, rotary_head_dim: int, act_bytes: int) -> int:
        return 2 * batch * seq * rotary_head_dim * act_bytes  # cos and sin, kept by the multiplies

    def attention_problems(self, attention, *, d_model: int, stack_heads: int, at: Loc) -> Problems:
        width = attention.rotary_head_dim(d_model)
        if width % 2:
            return [(at, f"interleaved_rope rotates pairs; this attention rotates an odd width ({width})")]
        return []
