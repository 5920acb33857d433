"""Attention config: multi-head, grouped-query and multi-query attention."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from blocks.configs.base import (
    AttentionBlock,
    CacheLayout,
    CacheTensor,
    Problems,
    Shapes,
    indivisible,
    kernel_saved_bytes,
    rule_error,
)
from blocks.limits import MAX_FACTOR, MAX_HEADS, MAX_SEQ_LEN, MAX_WIDTH
from blocks.registry import register


@register("attention", "blocks.attention:MultiHeadAttention")
class AttentionConfig(AttentionBlock):
    """Scaled dot-product attention with separate query and key/value head counts.

    ``n_kv_heads == n_heads`` is multi-head attention, ``1 < n_kv_heads < n_heads`` grouped-query
    (GQA), ``n_kv_heads == 1`` multi-query (MQA).
    """

    type: Literal["multi_head"] = Field(
        "multi_head", description="The attention block; multi_head covers MHA, GQA and MQA."
    )
    n_heads: int = Field(..., ge=1, le=MAX_HEADS, description="Number of query heads.")
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        le=MAX_HEADS,
        description="Number of key/value heads (defaults to n_heads); fewer is GQA, 1 is MQA. "
        "n_heads must be a multiple of it.",
    )
    head_dim: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Width of each head; defaults to d_model / n_heads (Gemma differs)."
    )
    qkv_bias: bool = Field(False, description="Biases on the query, key and value projections.")
    out_bias: bool = Field(False, description="A bias on the output projection.")
    sliding_window: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="A window w: query i sees key j only where i - j < w, itself included (Mistral). null: no window.",
    )
    scale: float | None = Field(
        None, gt=0, le=MAX_FACTOR, description="Score scale; null means 1/sqrt(head_dim). T5 uses 1.0."
    )
    softcap: float | None = Field(
        None, gt=0, le=MAX_FACTOR, description="A float c: scores become c * tanh(scores / c) (Gemma 2)."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the attention weights.")

    #: a cross-attention (over the encoder output) has no window
    not_inherited_by_cross: ClassVar[tuple[str, ...]] = ("sliding_window",)
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
            raise rule_error(
                ("n_kv_heads",),
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                f"try n_kv_heads: {_largest_divisor(self.n_heads, self.n_kv_heads)}",
            )
        return self

    def resolved_head_dim(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    # -- the attention contract (blocks.configs.base.AttentionBlock) ----------------------------

    def query_heads(self) -> int:
        return self.n_heads

    def rotary_head_dim(self, d_model: int) -> int:
        return self.resolved_head_dim(d_model)

    def window(self) -> int | None:
        return self.sliding_window

    def params(self, d_model: int) -> int:
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        weights = d_model * q + 2 * d_model * kv + q * d_model
        biases = (q + 2 * kv if self.qkv_bias else 0) + (d_model if self.out_bias else 0)
        return weights + biases

    def param_shapes(self, d_model: int) -> Shapes:
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        shapes = {
            "q_proj.weight": (q, d_model),
            "k_proj.weight": (kv, d_model),
            "v_proj.weight": (kv, d_model),
            "out_proj.weight": (d_model, q),
        }
        if self.qkv_bias:
            shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
        if self.out_bias:
            shapes["out_proj.bias"] = (d_model,)
        return shapes

    def parallel_plan(self) -> dict[str, str]:
        # Megatron's split: each rank computes whole heads; out_proj sums their outputs
        return {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise"}

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        kv = {"n_kv_heads": self.n_kv_heads} if self.n_kv_heads != self.n_heads else {}  # else said once, of n_heads
        return indivisible(degree, n_heads=self.n_heads, **kv)

    def tensor_parallel(self, degree: int, d_model: int) -> AttentionConfig:
        """``n_heads / degree`` query and ``n_kv_heads / degree`` key/value heads of the same width."""
        return self.model_copy(
            update={
                "n_heads": self.n_heads // degree,
                "n_kv_heads": self.n_kv_heads // degree,
                "head_dim": self.resolved_head_dim(d_model),
            }
        )

    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        projections = 2 * seq_q * d_model * q * 2  # query in, output out
        if kv_input:
            projections += 2 * seq_k * d_model * kv * 2  # key and value
        return projections

    def pair_flops(self, d_model: int) -> int:
        return 2 * 2 * self.n_heads * self.resolved_head_dim(d_model)  # Q.K^T and P.V

    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        hd = self.resolved_head_dim(d_model)
        tensors = (CacheTensor("k", self.n_kv_heads, hd), CacheTensor("v", self.n_kv_heads, hd))
        return CacheLayout(tensors, window=None if cross else self.sliding_window)

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
        """Both paths keep the projection input, q, the (rotated) k and v and the
        output-projection input. ``fused`` (FlashAttention: Triton on CUDA) adds the kernel's
        output and its fp32 log-sum-exp per row; ``eager`` (kernels.attention) keeps k and v
        repeated to n_heads for GQA, the fp32 softmax, a tanh output under softcap, a dropout
        mask, and the probabilities cast to the compute dtype for P.V (the softmax output itself
        when the dtype is fp32 and nothing ``masked`` them).
        """
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        tq, tk = batch * seq_q, batch * seq_k
        total = tq * d_model * act_bytes  # projection input (one tensor for q, k, v in self-attention)
        if kv_input and seq_k != seq_q:
            total += tk * d_model * act_bytes
        total += 2 * tq * q * act_bytes  # q; the output-projection input
        total += 2 * tk * (kv if fused else q) * act_bytes  # k, v (eager: repeated to n_heads when grouped)
        return total + kernel_saved_bytes(
            batch,
            self.n_heads,
            seq_q,
            seq_k,
            hd,
            act_bytes,
            fused,
            masked,
            softcap=self.softcap is not None,
            dropout=self.dropout > 0,
        )

    def problems(self, d_model: int, cross: bool) -> Problems:
        problems: Problems = []
        if cross and self.sliding_window is not None:
            problems.append((("sliding_window",), "cross-attention takes no sliding window"))
        if self.head_dim is None and d_model % self.n_heads:
            problems.append(
                (
                    ("n_heads",),
                    f"d_model ({d_model}) is not a multiple of n_heads ({self.n_heads}); "
                    "set head_dim or change n_heads",
                )
            )
        return problems

    def describe(self) -> str:
        """``8h/4kv w4096``."""
        heads = f"{self.n_heads}h" + (f"/{self.n_kv_heads}kv" if self.n_kv_heads != self.n_heads else "")
        return heads + (f" w{self.sliding_window}" if self.sliding_window else "")


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
