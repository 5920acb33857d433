"""Attention config: multi-head, grouped-query and multi-query attention."""

from __future__ import annotations

from typing import ClassVar, Literal

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

    #: configs the registry-wide tests build and count (d_model 32 unless the test says otherwise)
    examples: ClassVar[list[dict]] = [
        {"n_heads": 4},
        {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True},
        {"n_heads": 4, "n_kv_heads": 1, "out_bias": True},
        {"n_heads": 2, "head_dim": 24, "qkv_bias": True, "out_bias": True},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "sliding_window": 3},
        {"n_heads": 4, "softcap": 20.0, "scale": 1.0},
    ]

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

    def saved_bytes(
        self, d_model: int, batch: int, seq_q: int, seq_k: int, act_bytes: int, fused: bool,
        masked: bool, kv_input: bool = True,
    ) -> int:
        """Bytes this block keeps for backward in one training step (see builder.memory).

        Both paths keep the projection input, q, the (rotated) k and v and the output-projection
        input. ``fused`` (FlashAttention: Triton on CUDA) adds the kernel's output and its fp32
        log-sum-exp per row; ``eager`` (kernels.attention) keeps k and v repeated to n_heads
        for GQA, the fp32 softmax, a tanh output under softcap, a dropout mask, and the
        probabilities cast to the compute dtype for P.V (the softmax output itself when the
        dtype is fp32 and nothing ``masked`` them). ``kv_input=False``: the key/value input (an
        encoder output every cross-attention layer shares) is counted once, elsewhere.
        """
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        tq, tk = batch * seq_q, batch * seq_k
        total = tq * d_model * act_bytes  # projection input (one tensor for q, k, v in self-attention)
        if kv_input and seq_k != seq_q:
            total += tk * d_model * act_bytes
        total += 2 * tq * q * act_bytes  # q; the output-projection input
        pairs = batch * self.n_heads * seq_q * seq_k
        if fused:
            total += 2 * tk * kv * act_bytes  # k, v
            total += tq * q * act_bytes  # kernel output
            total += batch * self.n_heads * seq_q * 4  # fp32 log-sum-exp
            return total
        total += 2 * tk * q * act_bytes  # k, v (repeated to n_heads when grouped)
        total += pairs * 4  # fp32 softmax output
        if self.softcap is not None:
            total += pairs * 4  # tanh output
        if self.dropout > 0:
            total += pairs * (1 + act_bytes)  # mask; dropped probabilities
        elif act_bytes != 4 or masked:
            total += pairs * act_bytes  # probabilities cast (or masked) for P.V
        return total

    def kv_cache_bytes(self, d_model: int, batch: int, context: int, cache_bytes: int) -> int:
        """Bytes of one layer's key and value cache for ``context`` positions."""
        kv = self.n_kv_heads * self.resolved_head_dim(d_model)
        return 2 * batch * context * kv * cache_bytes


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: int | None) -> int:
    """How many (query, key) pairs the mask keeps; queries are the last seq_q positions.

    Query row i sits at position ``i + seq_k - seq_q``; ``causal`` keeps keys at or before it,
    a window ``w`` keeps keys fewer than ``w`` positions back. Closed form (O(1)).
    """
    if not causal and window is None:
        return seq_q * seq_k
    first, last = seq_k - seq_q, seq_k - 1  # query positions
    if causal:
        # keys 0..pos, capped at w: min(pos + 1, w) for each query position pos >= 0
        lo, hi = max(first, 0) + 1, last + 1
        return _sum_min(lo, hi, window if window is not None else hi)
    # window, not causal: every later key plus the w - 1 before: seq_k - max(0, pos - w + 1)
    n = last - first + 1
    return n * seq_k - _sum_range(max(first - window + 1, 1), last - window + 1)


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when empty)."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def _sum_min(lo: int, hi: int, cap: int) -> int:
    """sum of min(m, cap) for m in lo..hi."""
    if hi < lo:
        return 0
    return _sum_range(lo, min(hi, cap)) + cap * max(0, hi - max(lo, cap + 1) + 1)


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
