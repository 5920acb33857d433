"""The contracts of the kinds that mix positions (torch-free): an attention block
(:class:`AttentionBlock`: its counts, its heads, what it caches while decoding, as a
:class:`CacheLayout` of :class:`CacheTensor`), and a position encoding (:class:`PositionBlock`).
The rest of the kinds' contracts, and the table of them, are in ``yamlformer.blocks.configs.base``.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar, Literal

from yamlformer.blocks.configs.block import BlockConfig, Loc, Problems, Shapes
from yamlformer.blocks.configs.pairs import visible_pairs
from yamlformer.blocks.configs.traffic import Traffic, layout_copy

# -- attention ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    """One tensor a decoding cache holds per position: ``(batch, heads, positions, width)``."""

    name: str
    heads: int
    width: int


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What one attention layer caches per token while decoding, and for how many tokens.

    Multi-head attention caches ``k`` and ``v`` (``n_kv_heads x head_dim`` each); a latent
    attention may cache one compressed vector and a shared rotary key instead. ``window``: only
    the last ``window`` positions are kept (a ring buffer). ``yamlformer.blocks.cache.TensorCache``
    allocates exactly this, so ``describe``'s KV bytes are what ``generate`` allocates.
    """

    tensors: tuple[CacheTensor, ...]
    window: int | None = None

    def positions(self, context: int) -> int:
        return min(context, self.window) if self.window is not None else context

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return sum(t.heads * t.width for t in self.tensors) * dtype_bytes

    def nbytes(self, batch: int, context: int, dtype_bytes: int) -> int:
        """Bytes for ``batch`` sequences of ``context`` tokens."""
        return batch * self.positions(context) * self.bytes_per_token(dtype_bytes)


class AttentionBlock(BlockConfig):
    """An attention block: what generic code asks of it.

    Its module is built as ``Module(config, d_model, causal=..., cross=..., backend=...)`` (any
    subset of those by name, see ``yamlformer.blocks.build``) and follows the module protocol in
    ``blocks/attention.py``: ``forward(x, inputs, cache=None, memory=None)``, ``n_heads`` and
    ``new_cache(batch, max_tokens, dtype, device)``.
    """

    #: fields a cross-attention does not take over from its stack's self-attention
    #: (``cross_attention:`` merges over ``attention:`` without them; a sliding window)
    not_inherited_by_cross: ClassVar[tuple[str, ...]] = ()

    def context_parallel_problems(self, degree: int) -> Problems:
        """An attention splits its sequence only where its module says how (``use_context_parallel``;
        its config then returns none)."""
        name = getattr(self, "type", type(self).__name__)
        return [(("type",), f"{name} attention does not split its sequence between context-parallel ranks")]

    @abstractmethod
    def query_heads(self) -> int:
        """Number of query heads (ALiBi slopes, a relative-bias table and its rules use it)."""

    @abstractmethod
    def rotary_head_dim(self, d_model: int) -> int:
        """Width of the part of each query and key head an attention-side position rotates
        (``head_dim``; MLA: ``qk_rope_head_dim``). RoPE's ``rotary_fraction`` applies to it."""

    @abstractmethod
    def params(self, d_model: int) -> int:
        """Exact parameter count."""

    @abstractmethod
    def param_shapes(self, d_model: int) -> Shapes:
        """Every parameter tensor of the module, by ``named_parameters()`` name, with its shape."""

    @abstractmethod
    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        """FLOPs of every projection of one sequence (``kv_input=False``: cross-attention keys
        and values a cache already holds are left out)."""

    @abstractmethod
    def pair_flops(self, d_model: int) -> int:
        """FLOPs of the scores and the weighted sum for one (query, key) pair, all heads."""

    @abstractmethod
    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        """What decoding caches per token (``cross``: the encoder output's projections)."""

    @abstractmethod
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
        """Bytes kept for backward in one training step (see ``yamlformer.builder.analysis.memory``). ``fused``: a
        FlashAttention kernel; ``masked``: eager attention adds a mask or bias to the scores;
        ``kv_input=False``: the key/value input is shared (an encoder output) and counted once."""

    def score_head_dim(self, d_model: int) -> int | None:
        """The width each query-key product sums over (muP scales scores by ``1 / width`` rather
        than ``1 / sqrt(width)``); None: not declared, which a muP spec refuses at the block."""
        return None

    def with_score_factor(self, factor: float, d_model: int) -> AttentionBlock | None:
        """This attention with every score multiplied by ``factor`` on top of the scale it has
        (muP's attention scale at another head width); None: it cannot say so (muP refuses it)."""
        return None

    def window(self) -> int | None:
        """How far back a query sees (itself included); None: no window."""
        return None

    def chunk(self) -> int | None:
        """A chunk size C: a query sees only keys of its own chunk of C positions (query ``i``
        and key ``j`` with ``i // C == j // C``); None: no chunks."""
        return None

    def rotation_fields(self) -> tuple[str, ...]:
        """The fields set on this attention that only a position block which ``rotates`` serves
        (``rope: false``, a layer's ``rope_theta``): :meth:`PositionBlock.attention_problems`
        refuses them under any other position."""
        return ()

    def visible_pairs(self, seq_q: int, seq_k: int, causal: bool) -> int:
        """(query, key) pairs the mask keeps; queries are the last ``seq_q`` positions."""
        return visible_pairs(seq_q, seq_k, causal, self.window(), self.chunk())

    def masked(self, causal: bool) -> bool:
        """Whether eager attention adds a mask to the scores (and so copies the probabilities)."""
        return causal or self.window() is not None or self.chunk() is not None

    def rotated_heads(self) -> int:
        """Query and key heads per token a rotating position block turns (each
        :meth:`rotary_head_dim` wide); by default twice the query heads (as many keys)."""
        return 2 * self.query_heads()

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of the memory-bound work around the attention kernel
        (``yamlformer.blocks.configs.traffic``; the rotation is the position block's): by default the
        kernel's output copied from heads back to tokens before the output projection, one value
        per query head and head width (``pair_flops / 4``)."""
        return layout_copy(self.pair_flops(d_model) // 4, act_bytes)

    def flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        """Forward FLOPs of one sequence: projections, scores and mix over the full (seq_q, seq_k)
        as eager attention computes them."""
        return self.projection_flops(d_model, seq_q, seq_k, kv_input) + seq_q * seq_k * self.pair_flops(d_model)

    def kernel_flops(self, d_model: int, seq_q: int, seq_k: int, causal: bool, kv_input: bool = True) -> int:
        """Forward FLOPs a tiled kernel performs: scores and mix over the visible pairs only (MFU)."""
        pairs = self.visible_pairs(seq_q, seq_k, causal)
        return self.projection_flops(d_model, seq_q, seq_k, kv_input) + pairs * self.pair_flops(d_model)

    def kv_cache_bytes(self, d_model: int, batch: int, context: int, dtype_bytes: int, cross: bool = False) -> int:
        return self.kv_cache(d_model, cross).nbytes(batch, context, dtype_bytes)

    def problems(self, d_model: int, cross: bool) -> Problems:
        """Rules that need the model's width or the block's role (``cross``: a cross-attention)."""
        return []

    def for_cross_attention(self):
        """The config a cross-attention defaults to: this one without ``not_inherited_by_cross``."""
        fields = type(self).model_fields
        return self.model_copy(update={name: fields[name].default for name in self.not_inherited_by_cross})


class PositionBlock(BlockConfig):
    """A position block, one per stack. ``acts_on``: ``"embedding"`` (its module returns
    ``(batch, seq, d_model)`` added to the token embeddings) or ``"attention"`` (its module's
    hooks rotate q/k or add to the scores; see ``blocks/positions.py``)."""

    acts_on: ClassVar[Literal["embedding", "attention"]] = "attention"
    #: adds a term to the attention scores (ALiBi, relative bias): eager attention then masks
    biases_scores: ClassVar[bool] = False
    #: rotates queries and keys, at another base when a layer asks (its module's
    #: ``rotate(q, k, positions, theta=...)``): a layer may then set ``rope: false`` or ``rope_theta``
    rotates: ClassVar[bool] = False

    def params(self, d_model: int, n_heads: int, max_seq_len: int) -> int:
        """Parameters one stack's block builds (``n_heads``: the stack's query heads)."""
        return 0

    def param_shapes(self, d_model: int, n_heads: int, max_seq_len: int) -> Shapes:
        return {}

    def flops(self, d_model: int, n_heads: int, tokens: int) -> int:
        """Matrix-product FLOPs of one sequence (elementwise work counts 0)."""
        return 0

    def saved_bytes_per_layer(self, batch: int, seq: int, rotary_head_dim: int, act_bytes: int) -> int:
        """Bytes each attention layer keeps for backward on this block's behalf."""
        return 0

    def saved_bytes_per_stack(self, seq: int, n_heads: int, fused: bool) -> int:
        """Bytes a stack keeps once for backward on this block's behalf (shared by its layers)."""
        return 0

    def traffic_per_layer(self, heads: int, rotary_head_dim: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of this block's work in each attention layer
        (``yamlformer.blocks.configs.traffic``): ``heads`` query and key heads it may rotate, each
        ``rotary_head_dim`` wide (``AttentionBlock.rotated_heads``); none by default."""
        return Traffic()

    def problems(self, d_model: int, max_seq_len: int) -> Problems:
        """Rules over this block and the model's dimensions."""
        return []

    def attention_problems(self, attention: AttentionBlock, *, d_model: int, stack_heads: int, at: Loc) -> Problems:
        """Rules over this block and one self-attention block it acts in. ``at``: where that
        attention sits in the spec; ``stack_heads``: its stack's own query heads. Locations are
        relative to the spec (this block sits at ``("position",)``). This base refuses the
        attention's :meth:`~AttentionBlock.rotation_fields` unless the block ``rotates``; an
        override adds its own rules to ``super()``'s."""
        if self.rotates:
            return []
        kind = getattr(self, "type", type(self).__name__)
        return [
            (at + (name,), f"{name} needs a rotary position block (position: {{type: rope}}); this spec's is {kind}")
            for name in attention.rotation_fields()
        ]
