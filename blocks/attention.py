"""Multi-head attention (MHA, GQA, MQA), self- or cross-attention, with every score option;
and the module protocol every attention block follows.

The protocol (what ``yamlformer.blocks.layers``, ``yamlformer.blocks.stacks`` and
``yamlformer.blocks.generation`` ask of an attention module):

* ``forward(x, inputs, cache=None, memory=None) -> (batch, seq_q, d_model)``: ``inputs`` is the
  stack's :class:`AttentionInputs` (positions, padding, the position block's hooks), ``cache``
  this sub-layer's entry from ``new_cache`` (or None), ``memory`` the encoder output for a
  cross-attention;
* ``n_heads``: query heads (the stack precomputes score biases for them);
* ``new_cache(batch, max_tokens, dtype, device)``: an object with ``reorder(index)``,
  ``advance(n)`` and ``nbytes()``, whose bytes equal the config's ``kv_cache(d_model, cross)``
  layout (``yamlformer.blocks.cache.TensorCache`` / ``MemoryCache`` do this for any layout);
* ``static_decode = True`` (optional): ``forward`` honours ``inputs.index``, the static
  decoding step (it passes ``index=inputs.index`` to ``TensorCache.update`` and masks by the
  slots' token indices, ``inputs.bias`` / ``inputs.token_index``). ``generate`` decodes a stack
  whose every attention declares it with one fixed-shape step (compilable); any other stack
  feeds each token through the ordinary forward.
* ``document_masking = True`` (optional): ``forward`` honours ``inputs.document_ids`` (several
  documents packed in one row: no query sees another document's keys), by passing it to
  ``yamlformer.kernels.attention`` as ``document_ids``. A stack given ``document_ids`` refuses a layer whose
  attention does not declare it, rather than let its queries read across documents.
* ``use_context_parallel(group)`` (optional): attend over a sequence split between the ranks
  of ``group``, each holding the tokens ``AttentionInputs.query_index`` names
  (``yamlformer.recipes.parallel.context``); context parallelism refuses a model whose attention lacks it.

Projections here are separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` linear
layers (Hugging Face's names). The scores go through ``yamlformer.kernels.attention`` with the backend
chosen per model (``eager`` | ``sdpa`` | ``triton`` | ``auto``).

The per-layer options of ``multi_head`` (``yamlformer.blocks.configs.attention``), in the order the
forward applies them: ``qk_norm`` on q and k (``q_norm`` / ``k_norm``, Hugging Face's names; per
head or over the whole projection), the rotation (none on a ``rope: false`` layer; at the
layer's own ``rope_theta`` through the position block's hook), ``temperature_tuning``'s factor
on the queries at their positions; ``sinks`` (a parameter ``(n_heads,)``) and ``chunk_size`` go
to the kernel. Chunks follow position ids: in a packed row each document's chunks start at its
own first token, in a left-padded row at its first real token (as Hugging Face's Llama 4 counts
them), as when the sequence runs alone and unpadded. The KV cache holds the normed, rotated
keys and the values exactly as without the options; a chunked layer keeps every token (its
layout has no window), the masks reading the cached keys' token indices or positions.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd

from yamlformer.blocks.cache import MemoryCache, TensorCache
from yamlformer.blocks.linear import Linear
from yamlformer.blocks.tensor_parallel import shared
from yamlformer.kernels import Mask
from yamlformer.kernels import attention as attention_kernel


class AttentionInputs:
    """Per-forward inputs shared by a stack's attention layers.

    Args:
        start: token index of the first query (tokens already in the cache; 0 without one).
        seq_q: number of queries.
        positions: ``(batch, seq_q)`` position ids (differ from indices under left padding).
        key_mask: ``(batch, n_keys)`` bool, True for real tokens, by token index; None: no padding.
        position: the stack's position module when it acts in attention (its ``rotate``,
            ``alibi_slopes`` and ``score_bias`` hooks, see ``yamlformer.blocks.positions``), else None.
        index: the static decoding step's ``(1,)`` long token index of its one query (then
            ``start`` is unused and ``key_mask`` covers every token the cache was allocated
            for): a cache writes at it and returns whole buffers with each slot's token index
            (``yamlformer.blocks.cache``), which :meth:`bias` and :meth:`token_index` take instead of ``first``.
        document_ids: ``(batch, seq_q)`` integer document of each token, non-decreasing along a
            row (the stack's ``document_ids``; ``positions`` then restart at each document): a
            self-attention without cached keys passes it to ``yamlformer.kernels.attention``, which masks
            every score across documents. None: one document per row.
        query_index: ``(seq_q,)`` long index of each query in the whole sequence, when these are
            a context-parallel rank's share of it (``positions`` are then those indices); a
            context-parallel attention gathers the keys of every share and masks by these
            indices (:meth:`context_index`). None: tokens ``start .. start + seq_q``.
    """

    def __init__(
        self,
        start: int,
        seq_q: int,
        positions=None,
        key_mask=None,
        position=None,
        index=None,
        document_ids=None,
        query_index=None,
    ):
        self.start, self.seq_q = start, seq_q
        self.index = index
        self.query_index = query_index
        self.document_ids = document_ids
        self.positions = positions
        self.key_mask = key_mask
        self.position = position
        self._bias_memo: dict = {}

    def rotate(self, q: torch.Tensor, k: torch.Tensor, theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` rotated at the query positions by the position block (if it rotates);
        ``theta``: at that base instead of the block's own (a rotary block's ``rotates``)."""
        if self.position is None:
            return q, k
        if theta is not None:
            return self.position.rotate(q, k, self.positions, theta=theta)
        return self.position.rotate(q, k, self.positions)

    def alibi_slopes(self, n_heads: int, device) -> torch.Tensor | None:
        return self.position.alibi_slopes(n_heads, device) if self.position is not None else None

    def score_scale(self) -> float:
        """The position block's factor on every score (YaRN's temperature under DeepSeek's
        ``mscale_all_dim``), to multiply into the attention's own scale; 1.0 without one."""
        return self.position.score_scale() if self.position is not None else 1.0

    def token_index(self, keys) -> tuple | None:
        """``yamlformer.kernels.attention``'s ``token_index`` for keys a static cache returned (their slots'
        token indices, a tensor); None for keys in token order (``first``, an int)."""
        return (self.index, keys) if isinstance(keys, torch.Tensor) else None

    def context_index(self, group) -> tuple[torch.Tensor, torch.Tensor]:
        """``yamlformer.kernels.attention``'s ``token_index`` for this rank's queries and the keys of every
        rank of the context-parallel ``group`` gathered in rank order: ``(query_index, the
        group's query indices concatenated)``, gathered once per forward."""
        if "context" not in self._bias_memo:
            # local: the functional collectives (~0.1 s to import) serve context- and expert-parallel runs only
            from torch.distributed._functional_collectives import all_gather_single

            self._bias_memo["context"] = (self.query_index, all_gather_single(self.query_index, 0, group))
        return self._bias_memo["context"]

    def bias(self, first, seq_k: int, n_heads: int, device) -> torch.Tensor | None:
        """Additive ``(batch | 1, n_heads | 1, seq_q | 1, seq_k)`` bias for keys ``first .. first+seq_k``
        (or, in a static step, the keys whose token indices the tensor ``first`` holds): padding
        and the position block's score bias."""
        if isinstance(first, torch.Tensor):
            return self._slot_bias(first, n_heads, device)
        key = (first, seq_k, n_heads)
        if key in self._bias_memo:
            return self._bias_memo[key]
        bias = None
        if self.key_mask is not None:
            if self.key_mask.shape[1] < first + seq_k:
                raise ValueError(
                    f"attention_mask covers {self.key_mask.shape[1]} tokens but the keys reach token "
                    f"{first + seq_k}; pass a mask over the cached and the new tokens"
                )
            keep = self.key_mask[:, first : first + seq_k].bool()  # (batch, seq_k)
            bias = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_fill(~keep, float("-inf"))
            bias = bias[:, None, None, :]  # (batch, 1, 1, seq_k)
        if self.position is not None:
            q_index = torch.arange(self.start, self.start + self.seq_q, device=device)
            k_index = torch.arange(first, first + seq_k, device=device)
            scores = self.position.score_bias(q_index, k_index, n_heads)  # (1, n_heads, seq_q, seq_k)
            if scores is not None:
                bias = scores.float() if bias is None else bias + scores.float()
        self._bias_memo[key] = bias
        return bias

    def chunk_bias(self, first, seq_k: int, chunk: int, device) -> torch.Tensor:
        """Additive ``(batch, 1, seq_q, seq_k)`` bias keeping for each query the keys of its chunk
        of ``chunk`` positions, by position ids (``key_mask``'s running count, as the stack
        numbers a padded row), so a left-padded row's chunks start at its first real token as an
        unpadded row's do; keys ``first .. first+seq_k`` or a static step's slots (``first`` the
        tensor of their token indices). Shared by every chunked layer of the forward."""
        memo = ("chunk", first.shape[0] if isinstance(first, torch.Tensor) else first, seq_k, chunk)
        if memo in self._bias_memo:
            return self._bias_memo[memo]
        counted = (self.key_mask.long().cumsum(-1) - 1).clamp(min=0)  # (batch, tokens): each token's position
        if isinstance(first, torch.Tensor):
            key_positions = counted.index_select(1, first.clamp(min=0))  # (batch, capacity)
        else:
            key_positions = counted[:, first : first + seq_k]  # (batch, seq_k)
        same = (self.positions // chunk)[:, :, None] == (key_positions // chunk)[:, None, :]  # (batch, seq_q, seq_k)
        bias = torch.zeros(same.shape, dtype=torch.float32, device=device).masked_fill(~same, float("-inf"))
        self._bias_memo[memo] = bias[:, None]  # (batch, 1, seq_q, seq_k)
        return self._bias_memo[memo]

    def _slot_bias(self, keys: torch.Tensor, n_heads: int, device) -> torch.Tensor | None:
        """:meth:`bias` over a static cache's slots, ``keys`` ``(capacity,)`` their token indices
        (negative: empty, masked by the kernel). Every layer of one step asks with the same
        capacity and heads, and gets the same tensor."""
        key = ("slots", keys.shape[0], n_heads)
        if key in self._bias_memo:
            return self._bias_memo[key]
        bias = None
        if self.key_mask is not None:
            keep = self.key_mask.index_select(1, keys.clamp(min=0)).bool()  # (batch, capacity)
            bias = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_fill(~keep, float("-inf"))
            bias = bias[:, None, None, :]  # (batch, 1, 1, capacity)
        if self.position is not None:
            scores = self.position.score_bias(self.index, keys, n_heads)  # (1, n_heads, 1, capacity)
            if scores is not None:
                bias = scores.float() if bias is None else bias + scores.float()
        self._bias_memo[key] = bias
        return bias


class QKNorm(nn.Module):
    """``q_norm`` / ``k_norm``: ``x * rsqrt(mean(x^2) + eps)`` over the last dimension in fp32,
    times ``weight`` (``1 + weight`` under ``unit_offset``) and back in the input's dtype, as
    Gemma 3's and OLMo 2's norms compute (Qwen3's casts before the weight: the same in fp32);
    ``l2`` has no weight (Llama 4). Under tensor parallelism a weight shared by the heads passes
    through ``shared`` (the gradient summed over the group: each rank normalises its heads)."""

    def __init__(self, config, width: int):
        super().__init__()
        self.eps, self.unit_offset = config.eps, config.unit_offset
        self.shared = None
        if config.type == "rmsnorm":
            self.weight = nn.Parameter(torch.zeros(width) if config.unit_offset else torch.ones(width))
        else:
            self.register_parameter("weight", None)

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {} if self.weight is None else {"weight": ("constant", 0.0 if self.unit_offset else 1.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return normed.to(x.dtype)
        weight = self.weight if self.shared is None else self.shared(self.weight)
        scale = weight.float() + 1.0 if self.unit_offset else weight.float()
        return (normed * scale).to(x.dtype)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with ``n_heads`` query and ``n_kv_heads`` key/value heads.

    ``cross=True`` takes keys and values from ``memory`` (the encoder output) and applies no
    causal mask, window, chunks or position; otherwise keys and values come from ``x`` and the
    mask is causal when ``causal=True``. The per-layer options: the module doc.
    """

    static_decode = True  # honours AttentionInputs.index (module doc)
    document_masking = True  # honours AttentionInputs.document_ids (module doc)

    def __init__(self, config, d_model: int, causal: bool = False, cross: bool = False, backend: str = "auto"):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.resolved_head_dim(d_model)
        self.causal = causal and not cross
        self.cross = cross
        self.sliding_window = None if cross else config.sliding_window
        self.chunk_size = None if cross else config.chunk_size
        self.rope = config.rope and not cross
        self.rope_theta = config.rope_theta
        self.temperature = None if cross else config.temperature_tuning
        self.scale = config.scale
        self.softcap = config.softcap
        self.dropout = config.dropout
        self.backend = backend
        self.cache_layout = config.kv_cache(d_model, cross=cross)
        self.first_head, self.total_heads = 0, self.n_heads  # this module's heads among the layer's (tensor parallel)
        self.group = None  # the tensor-parallel group whose ranks hold the other heads
        self.context_group = None  # the context-parallel group whose ranks hold the other tokens
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(d_model, q_dim, bias=config.qkv_bias)
        self.k_proj = Linear(d_model, kv_dim, bias=config.qkv_bias)
        self.v_proj = Linear(d_model, kv_dim, bias=config.qkv_bias)
        self.out_proj = Linear(q_dim, d_model, bias=config.out_bias)
        norm = config.qk_norm
        self.norm_heads = norm is not None and norm.over == "head"  # else over the whole projection
        if norm is not None:
            self.q_norm = QKNorm(norm, norm.width(self.head_dim, self.n_heads))
            self.k_norm = QKNorm(norm, norm.width(self.head_dim, self.n_kv_heads))
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.sinks else None

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"sinks": ("normal", std)} if self.sinks is not None else {}  # GPT-OSS's init

    def use_tensor_parallel(self, rank: int, degree: int) -> None:
        """Compute this rank's share of the heads, after the config's plan split the projections:
        heads ``rank * n_heads / degree ..`` of the query and key/value heads. The per-head norm
        weights, shared by the heads, and the sinks stay whole on every rank (each reads its heads'
        sinks); their gradients are summed over the group, so every copy stays the same."""
        self.n_heads //= degree
        self.n_kv_heads //= degree
        self.first_head = rank * self.n_heads
        mesh = getattr(self.q_proj.weight, "device_mesh", None)  # a DTensor once the plan applied
        self.group = mesh.get_group() if mesh is not None else None
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.shared = self._shared

    def use_context_parallel(self, group) -> None:
        """Attend over a sequence split between the ranks of ``group`` (Llama 3's all-gather
        context parallelism): each rank projects and rotates its own tokens (at their positions
        in the whole sequence, ``AttentionInputs.query_index``), gathers every rank's keys and
        values (the gradient reduce-scattered back) and scores its queries against all of them,
        masked by their token indices, so causal masks, windows, chunks and ALiBi are exact."""
        if self.cross:
            raise ValueError("context parallelism splits a self-attention's sequence; this is a cross-attention")
        self.context_group = group

    def _context_keys(self, k, v, inputs: AttentionInputs, cache) -> tuple:
        """Every context-parallel rank's keys and values, and the token indices to mask them by."""

        if inputs.query_index is None or cache is not None or inputs.document_ids is not None:
            raise ValueError(
                "a context-parallel attention takes its share of a sequence with its token indices "
                "(the stack's token_index), without a cache or packed documents"
            )
        if inputs.key_mask is not None:
            raise ValueError("a context-parallel attention takes no padding mask (whole windows only)")
        k = all_gather_single_autograd(k.contiguous(), 2, self.context_group)
        v = all_gather_single_autograd(v.contiguous(), 2, self.context_group)
        return k, v, inputs.context_index(self.context_group)

    def _shared(self, t: torch.Tensor) -> torch.Tensor:
        return shared(t, self.group)

    def _heads(self, x: torch.Tensor, proj: Linear, n_heads: int, norm: QKNorm | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        y = proj(x)  # (batch, seq, n_heads * head_dim)
        if norm is not None and not self.norm_heads:
            y = norm(y)  # over the whole projection (OLMo 2)
        y = y.view(batch, seq, n_heads, self.head_dim)
        if norm is not None and self.norm_heads:
            y = norm(y)  # over each head (Qwen3, Gemma 3, Llama 4's l2)
        return y.transpose(1, 2)  # (batch, heads, seq, head_dim)

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output, ``(batch, n_kv_heads, src, head_dim)``."""
        return (
            self._heads(memory, self.k_proj, self.n_kv_heads, self.k_norm),
            self._heads(memory, self.v_proj, self.n_kv_heads),
        )

    def new_cache(self, batch: int, max_tokens: int, dtype: torch.dtype, device):
        """Keys and values for decoding (cross-attention: the encoder output's, projected once)."""
        if self.cross:
            return MemoryCache()
        return TensorCache(self.cache_layout, batch, max_tokens, dtype, device)

    def _temperature(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's tuning: ``q * (log(floor((position + 1) / floor_scale) + 1) * scale + 1)``."""
        t = self.temperature
        steps = torch.floor((positions.float() + 1.0) / t.floor_scale)  # (batch, seq_q)
        factor = torch.log1p(steps) * t.scale + 1.0
        return q * factor[:, None, :, None].to(q.dtype)  # (batch, 1, seq_q, 1) over the heads

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache=None, memory=None) -> torch.Tensor:
        """``x`` ``(batch, seq_q, d_model)`` -> ``(batch, seq_q, d_model)``."""
        batch, seq_q, _ = x.shape
        q = self._heads(x, self.q_proj, self.n_heads, self.q_norm)  # (batch, n_heads, seq_q, head_dim)
        alibi, context_index = None, None
        if self.cross:
            if cache is not None and cache.tensors is not None:
                k, v = cache.tensors
            else:
                if memory is None:
                    raise ValueError("cross-attention needs the encoder output (memory)")
                k, v = self.project_memory(memory)
                if cache is not None:
                    cache.tensors = (k, v)
            first = 0
        else:
            k = self._heads(x, self.k_proj, self.n_kv_heads, self.k_norm)  # (batch, n_kv_heads, seq_q, head_dim)
            v = self._heads(x, self.v_proj, self.n_kv_heads)
            if self.rope:
                q, k = inputs.rotate(q, k, theta=self.rope_theta)
            if self.temperature is not None:
                positions = inputs.positions
                if positions is None:  # no position ids given: the token indices
                    positions = torch.arange(inputs.start, inputs.start + seq_q, device=x.device)[None]
                q = self._temperature(q, positions)
            first = inputs.start
            if self.context_group is not None:
                k, v, context_index = self._context_keys(k, v, inputs, cache)
            elif cache is not None:  # keys first .. first + seq_k in token order (a static step: every slot)
                k, v, first = cache.update(k, v, index=inputs.index)
            slopes = inputs.alibi_slopes(self.total_heads, x.device)
            alibi = slopes[self.first_head : self.first_head + self.n_heads] if slopes is not None else None
        bias = inputs.bias(first, k.shape[2], self.total_heads, x.device)
        if self.context_group is not None and bias is not None:
            raise ValueError("a context-parallel attention takes no score bias (padding, relative-position tables)")
        if bias is not None and bias.shape[1] > self.n_heads:  # (batch | 1, total_heads, ...): this rank's heads
            bias = bias[:, self.first_head : self.first_head + self.n_heads]
        chunk_size = self.chunk_size
        if chunk_size is not None and inputs.key_mask is not None:  # padded: chunks by position ids
            chunks = inputs.chunk_bias(first, k.shape[2], chunk_size, x.device)
            bias, chunk_size = (chunks if bias is None else bias + chunks), None
        # the position block's factor belongs to its scaled rotation, not to a layer's own base
        scale, factor = self.scale, (inputs.score_scale() if self.rope_theta is None else 1.0)
        if factor != 1.0:
            scale = (scale if scale is not None else self.head_dim**-0.5) * factor
        token_index = context_index if self.context_group is not None else inputs.token_index(first)
        if token_index is None and chunk_size is not None and first != 0:
            # a ring buffer's keys start past token 0: chunks are by absolute token index
            token_index = (
                torch.arange(inputs.start, inputs.start + seq_q, device=x.device),
                torch.arange(first, first + k.shape[2], device=x.device),
            )
        mask = Mask(
            causal=self.causal,
            sliding_window=self.sliding_window,
            alibi_slopes=alibi,
            bias=bias,
            softcap=self.softcap,
            token_index=token_index,
            **self._kernel_options(inputs, chunk_size),
        )
        dropout = self.dropout if self.training else 0.0
        out = attention_kernel(
            q, k, v, mask, scale=scale, backend=self.backend, dropout_p=dropout
        )  # (batch, n_heads, seq_q, head_dim)
        out = out.transpose(1, 2).reshape(
            batch, seq_q, self.n_heads * self.head_dim
        )  # (batch, seq_q, n_heads * head_dim)
        return self.out_proj(out)

    def _kernel_options(self, inputs: AttentionInputs, chunk_size: int | None) -> dict:
        """The mask's ``document_ids``, ``sinks`` (this rank's heads') and ``chunk_size``, where
        set. In a packed row a document's chunks start at its own first token, as they do when it
        runs alone: each (document, chunk) pair becomes a document of its own (positions restart
        at 0 in each document, so a run begins wherever ``position % C == 0``) and the kernel masks
        by those runs instead of by ``chunk_size``."""
        options = {"document_ids": inputs.document_ids}
        if self.sinks is not None:
            options["sinks"] = self._shared(self.sinks)[self.first_head : self.first_head + self.n_heads]
        if chunk_size is not None:
            if inputs.document_ids is not None:
                options["document_ids"] = torch.cumsum(inputs.positions % chunk_size == 0, dim=1)  # (batch, seq)
            else:
                options["chunk_size"] = chunk_size
        return options
