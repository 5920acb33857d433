"""Attention config: multi-head, grouped-query and multi-query attention."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from blocks.configs.base import BlockConfig
from blocks.registry import register


@register("attention", "blocks.attention:MultiHeadAttention")
class AttentionConfig(BlockConfig):
    """Scaled dot-product attention with separate query and key/value head counts.

    ``n_kv_heads == n_heads`` is multi-head attention, ``1 < n_kv_heads < n_heads`` grouped-query
    (GQA), ``n_kv_heads == 1`` multi-query (MQA).
    """

    type: Literal["multi_head"] = Field(
        "multi_head", description="The attention block; multi_head covers MHA, GQA and MQA."
    )
    n_heads: int = Field(..., ge=1, description="Number of query heads.")
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        description="Number of key/value heads (defaults to n_heads); fewer is GQA, 1 is MQA. "
        "n_heads must be a multiple of it.",
    )
    head_dim: int | None = Field(
        None, ge=1, description="Width of each head; defaults to d_model / n_heads (Gemma differs)."
    )
    qkv_bias: bool = Field(False, description="Biases on the query, key and value projections.")
    out_bias: bool = Field(False, description="A bias on the output projection.")
    sliding_window: int | None = Field(
        None,
        ge=1,
        description="A window w: query i sees key j only where i - j < w, itself included "
        "(Mistral). null: no window.",
    )
    scale: float | None = Field(
        None, gt=0, description="Score scale; null means 1/sqrt(head_dim). T5 uses 1.0."
    )
    softcap: float | None = Field(
        None, gt=0, description="A float c: scores become c * tanh(scores / c) (Gemma 2)."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the attention weights.")

    @model_validator(mode="after")
    def _heads(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        elif self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                f"try n_kv_heads: {_largest_divisor(self.n_heads, self.n_kv_heads)}"
            )
        return self

    def resolved_head_dim(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    def params(self, d_model: int) -> int:
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        weights = d_model * q + 2 * d_model * kv + q * d_model
        biases = (q + 2 * kv if self.qkv_bias else 0) + (d_model if self.out_bias else 0)
        return weights + biases

    def flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        """Forward FLOPs of one sequence: projections, Q.K^T and P.V over the full (seq_q, seq_k).

        ``kv_input=False`` leaves out the key/value projections (cross-attention keys that a
        cache already holds).
        """
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        projections = 2 * seq_q * d_model * q * 2  # query in, output out
        if kv_input:
            projections += 2 * seq_k * d_model * kv * 2  # key and value
        scores_and_mix = 2 * 2 * seq_q * seq_k * q  # Q.K^T and P.V
        return projections + scores_and_mix

    def kernel_flops(self, d_model: int, seq_q: int, seq_k: int, causal: bool) -> int:
        """FLOPs of Q.K^T and P.V that a tiled kernel really needs under the mask (for MFU)."""
        q = self.n_heads * self.resolved_head_dim(d_model)
        return 2 * 2 * q * visible_pairs(seq_q, seq_k, causal, self.sliding_window)


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: int | None) -> int:
    """How many (query, key) pairs a query block sees; queries are the last seq_q positions."""
    if not causal and window is None:
        return seq_q * seq_k
    offset = seq_k - seq_q
    total = 0
    for i in range(seq_q):
        pos = i + offset
        hi = pos + 1 if causal else seq_k
        lo = max(0, pos - window + 1) if window is not None else 0
        total += max(0, hi - lo)
    return total


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
