"""Attention config: multi-head, grouped-query and multi-query attention, with its per-layer
options: QK-norm (Qwen3, Gemma 3, OLMo 2, Llama 4), attention sinks (GPT-OSS), chunked local
attention (Llama 4), NoPE layers and per-layer RoPE bases (Llama 4, Gemma 3) and attention
temperature tuning (Llama 4). Each option is a field usable in a layer's ``overrides:``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from yamlformer.blocks.configs.base import (
    AttentionBlock,
    BlockConfig,
    CacheLayout,
    CacheTensor,
    Classes,
    Problems,
    Shapes,
    indivisible,
    rule_error,
)
from yamlformer.blocks.configs.pairs import kernel_saved_bytes
from yamlformer.blocks.configs.tensors import hidden, vector
from yamlformer.blocks.limits import MAX_FACTOR, MAX_HEADS, MAX_SEQ_LEN, MAX_WIDTH
from yamlformer.blocks.registry import register


class QKNorm(BlockConfig):
    """A norm on the queries and keys after their projections, before RoPE."""

    type: Literal["rmsnorm", "l2"] = Field(
        "rmsnorm",
        description="rmsnorm: x * rsqrt(mean(x^2) + eps) times a learned weight (Qwen3, Gemma 3, OLMo 2); "
        "l2: the same without a weight (Llama 4's L2 norm; it commutes with RoPE).",
    )
    over: Literal["head", "projection"] = Field(
        "head",
        description="head: over each head's head_dim, one weight shared by the heads (Qwen3, Gemma 3); "
        "projection: over the whole query projection (n_heads * head_dim) and the whole key "
        "projection (n_kv_heads * head_dim) (OLMo 2).",
    )
    eps: float = Field(1e-6, gt=0, le=MAX_FACTOR, description="Added to the mean square.")
    unit_offset: bool = Field(
        False,
        description="rmsnorm only: scale by (1 + weight), the weight initialised to 0 (Gemma 3), "
        "instead of by the weight initialised to 1.",
    )

    @model_validator(mode="after")
    def _weightless(self):
        if self.type == "l2" and self.unit_offset:
            raise rule_error(("unit_offset",), "an l2 qk_norm has no weight to offset; remove unit_offset")
        return self

    def width(self, head_dim: int, heads: int) -> int:
        """The width one norm spans (its weight's length) for ``heads`` heads of ``head_dim``."""
        return head_dim if self.over == "head" else heads * head_dim


class TemperatureTuning(BlockConfig):
    """Llama 4's attention temperature tuning (arXiv:2501.19399): longer positions, sharper scores."""

    floor_scale: int = Field(
        ..., ge=1, le=MAX_SEQ_LEN, description="Positions per step of the log: floor((position + 1) / floor_scale)."
    )
    scale: float = Field(..., gt=0, le=MAX_FACTOR, description="The log's factor (Llama 4: attn_scale, 0.1).")


@register("attention", "yamlformer.blocks.attention:MultiHeadAttention")
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
    qk_norm: QKNorm | None = Field(
        None,
        description="A norm on q and k before RoPE: {type: rmsnorm | l2, over: head | projection, eps, "
        "unit_offset}; parameters q_norm.weight and k_norm.weight (rmsnorm). null: none.",
    )
    sinks: bool = Field(
        False,
        description="A learned logit per query head that joins every softmax row as one more column "
        "and is dropped after it, so a query may attend to nothing (GPT-OSS); parameter sinks (n_heads,).",
    )
    chunk_size: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="A chunk C: query at token index i sees key j only where i // C == j // C (and j <= i "
        "when causal): Llama 4's chunked local attention. Counted from a left-padded row's first real "
        "token and from each packed document's first token. null: no chunks.",
    )
    rope: bool = Field(
        True,
        description="false: this layer's queries and keys are not rotated (a NoPE layer among RoPE ones, "
        "Llama 4); needs a rotary position block.",
    )
    rope_theta: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="This layer's RoPE base instead of the position block's theta, rotating without the "
        "block's context scaling or its score factor (Gemma 3's local layers: 10,000 beside global ones at "
        "1,000,000 with linear scaling); rotary_fraction still applies. Needs a rotary position block. "
        "null: the block's.",
    )
    temperature_tuning: TemperatureTuning | None = Field(
        None,
        description="{floor_scale, scale}: queries multiplied by log(floor((position + 1) / floor_scale) + 1) "
        "* scale + 1 after any norm and rotation (Llama 4, on its NoPE layers). null: none.",
    )

    #: a tensor-parallel rank's view (:meth:`tensor_parallel`) holds every head's sinks
    _sink_heads: int | None = PrivateAttr(None)

    #: a cross-attention (over the encoder output) has no window, chunks or positions
    not_inherited_by_cross: ClassVar[tuple[str, ...]] = (
        "sliding_window",
        "chunk_size",
        "rope",
        "rope_theta",
        "temperature_tuning",
    )
    #: configs the registry-wide tests build and count (d_model 32 unless the test says otherwise)
    examples: ClassVar[list[dict]] = [
        {"n_heads": 4},
        {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True},
        {"n_heads": 4, "n_kv_heads": 1, "out_bias": True},
        {"n_heads": 2, "head_dim": 24, "qkv_bias": True, "out_bias": True},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "sliding_window": 3},
        {"n_heads": 4, "softcap": 20.0, "scale": 1.0},
        {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {}},  # Qwen3
        {"n_heads": 4, "head_dim": 12, "qk_norm": {"unit_offset": True, "eps": 1e-5}, "rope_theta": 50.0},  # Gemma 3
        {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {"over": "projection"}},  # OLMo 2
        {"n_heads": 4, "n_kv_heads": 2, "sinks": True, "sliding_window": 4, "qkv_bias": True},  # GPT-OSS
        {"n_heads": 4, "n_kv_heads": 1, "sinks": True, "softcap": 30.0},
        {"n_heads": 4, "n_kv_heads": 2, "chunk_size": 3, "qk_norm": {"type": "l2"}},  # Llama 4's RoPE layers
        {"n_heads": 4, "rope": False, "temperature_tuning": {"floor_scale": 4, "scale": 0.1}},  # its NoPE layers
        {"n_heads": 4, "n_kv_heads": 2, "chunk_size": 4, "sliding_window": 3, "sinks": True},
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
        if not self.rope and self.rope_theta is not None:
            raise rule_error(("rope_theta",), "rope: false rotates nothing; remove rope_theta or set rope: true")
        return self

    def resolved_head_dim(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    # -- the attention contract (yamlformer.blocks.configs.base.AttentionBlock) ----------------------------

    def query_heads(self) -> int:
        return self.n_heads

    def rotated_heads(self) -> int:
        return self.n_heads + self.n_kv_heads

    def rotary_head_dim(self, d_model: int) -> int:
        return self.resolved_head_dim(d_model) if self.rope else 0  # a NoPE layer rotates nothing

    def window(self) -> int | None:
        return self.sliding_window

    def chunk(self) -> int | None:
        return self.chunk_size

    def rotation_fields(self) -> tuple[str, ...]:
        return (() if self.rope else ("rope",)) + (("rope_theta",) if self.rope_theta is not None else ())

    def params(self, d_model: int) -> int:
        hd = self.resolved_head_dim(d_model)
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        weights = d_model * q + 2 * d_model * kv + q * d_model
        biases = (q + 2 * kv if self.qkv_bias else 0) + (d_model if self.out_bias else 0)
        return weights + biases + sum(shape[0] for shape in self._option_shapes(d_model).values())

    def _option_shapes(self, d_model: int) -> Shapes:
        """The options' parameters: the QK-norm weights and the sinks (each one-dimensional)."""
        hd = self.resolved_head_dim(d_model)
        shapes: Shapes = {}
        if self.qk_norm is not None and self.qk_norm.type == "rmsnorm":
            shapes["q_norm.weight"] = (self.qk_norm.width(hd, self.n_heads),)
            shapes["k_norm.weight"] = (self.qk_norm.width(hd, self.n_kv_heads),)
        if self.sinks:
            shapes["sinks"] = (self._sink_heads or self.n_heads,)
        return shapes

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
        return shapes | self._option_shapes(d_model)

    def tensor_classes(self, d_model: int) -> Classes:
        # the heads' widths grow with d_model; per-head norm weights and sinks are vectors
        classes = {name: hidden() for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")}
        per_head = self.qk_norm is not None and self.qk_norm.over == "head"
        for name in self.param_shapes(d_model):
            if name not in classes:
                classes[name] = vector(None if name == "sinks" else "head" if per_head else "d_model")
        return classes

    def score_head_dim(self, d_model: int) -> int:
        return self.resolved_head_dim(d_model)

    def with_score_factor(self, factor: float, d_model: int) -> AttentionConfig:
        scale = self.scale if self.scale is not None else self.resolved_head_dim(d_model) ** -0.5
        return self.model_copy(update={"scale": scale * factor})

    def parallel_plan(self) -> dict[str, str]:
        # Megatron's split: each rank computes whole heads; out_proj sums their outputs. A
        # per-head q_norm / k_norm weight (shared by the heads) and the sinks are replicated:
        # each rank reads its heads' sinks, and yamlformer.blocks.attention sums both gradients over the group
        return {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise"}

    def context_parallel_problems(self, degree: int) -> Problems:
        """None: the module all-gathers the keys and values of a split sequence and masks them by
        their token indices (``use_context_parallel``), so windows, chunks and ALiBi stay exact."""
        return []

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        kv = {"n_kv_heads": self.n_kv_heads} if self.n_kv_heads != self.n_heads else {}  # else said once, of n_heads
        problems = indivisible(degree, n_heads=self.n_heads, **kv)
        if degree > 1 and self.qk_norm is not None and self.qk_norm.over == "projection":
            problems.append(
                (
                    ("qk_norm", "over"),
                    "a norm over the whole projection spans every rank's heads; tensor parallelism "
                    "needs qk_norm over: head (or tensor_parallel: 1)",
                )
            )
        return problems

    def tensor_parallel(self, degree: int, d_model: int) -> AttentionConfig:
        """``n_heads / degree`` query and ``n_kv_heads / degree`` key/value heads of the same width;
        the sinks stay whole (replicated, :meth:`parallel_plan`)."""
        view = self.model_copy(
            update={
                "n_heads": self.n_heads // degree,
                "n_kv_heads": self.n_kv_heads // degree,
                "head_dim": self.resolved_head_dim(d_model),
            }
        )
        view._sink_heads = self._sink_heads or self.n_heads
        return view

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
        output and its fp32 log-sum-exp per row; ``eager`` (yamlformer.kernels.attention) keeps k and v
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
        if self.qk_norm is not None:
            total += self._norm_saved_bytes(tq, self.n_heads, hd, act_bytes)
            total += self._norm_saved_bytes(tk, self.n_kv_heads, hd, act_bytes)
        if self.temperature_tuning is not None:
            total += tq * act_bytes  # the (batch, 1, seq, 1) factor the multiply keeps
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
            sinks=self.sinks,
        )

    def _norm_saved_bytes(self, tokens: int, heads: int, hd: int, act_bytes: int) -> int:
        """What ``yamlformer.blocks.attention.QKNorm`` keeps over ``tokens`` of ``heads`` heads: the fp32 input
        (kept by the square and the multiply) and 1/rms per row; rmsnorm also the normalised input
        (kept by the multiply with the weight) and, unless it is the fp32 weight itself, the scale."""
        norm = self.qk_norm
        width = norm.width(hd, heads)
        rows = tokens * heads * hd // width
        total = tokens * heads * hd * 4 + rows * 4
        if norm.type == "rmsnorm":
            total += tokens * heads * hd * 4 + (width * 4 if norm.unit_offset or act_bytes != 4 else 0)
        return total

    def problems(self, d_model: int, cross: bool) -> Problems:
        problems: Problems = []
        if cross:
            taken = {
                "sliding_window": (self.sliding_window is not None, "a sliding window"),
                "chunk_size": (self.chunk_size is not None, "chunks"),
                "rope": (not self.rope, "rope: false (it has no positions to leave out)"),
                "rope_theta": (self.rope_theta is not None, "a RoPE base"),
                "temperature_tuning": (self.temperature_tuning is not None, "temperature tuning"),
            }
            problems += [((name,), f"cross-attention takes no {what}") for name, (bad, what) in taken.items() if bad]
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
        """``8h/4kv w4096``, with ``c8192`` (chunks), ``qk-norm``, ``sinks``, ``nope``, ``base10000``, ``temp``."""
        heads = f"{self.n_heads}h" + (f"/{self.n_kv_heads}kv" if self.n_kv_heads != self.n_heads else "")
        options = [
            f"w{self.sliding_window}" if self.sliding_window else "",
            f"c{self.chunk_size}" if self.chunk_size else "",
            "qk-norm" if self.qk_norm is not None else "",
            "sinks" if self.sinks else "",
            "nope" if not self.rope else "",
            f"base{self.rope_theta:g}" if self.rope_theta is not None else "",
            "temp" if self.temperature_tuning is not None else "",
        ]
        return " ".join([heads, *(o for o in options if o)])


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
