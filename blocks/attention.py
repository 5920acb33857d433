"""Multi-head attention: MHA, GQA and MQA, self- or cross-attention, with every score option.

Projections are separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` linear layers
(Hugging Face's names). The scores go through ``kernels.attention`` with the backend chosen per
model (``eager`` | ``sdpa`` | ``triton`` | ``auto``); this module only projects, places
positions and builds the additive bias (padding and T5 relative bias).

What a stack computes once per forward and every layer reads is an :class:`AttentionInputs`:
the query token indices, RoPE position ids, the key padding mask and the stack's position
blocks. A KV cache (``blocks.generation.LayerCache``) returns keys in token order together with
the index of the first one, so causal and window masks, ALiBi and relative bias stay exact at
any decoding offset.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import attention as attention_kernel


class AttentionInputs:
    """Per-forward inputs shared by a stack's attention layers.

    Args:
        start: token index of the first query (tokens already in the cache; 0 without one).
        seq_q: number of queries.
        positions: ``(batch, seq_q)`` position ids for RoPE (differ from indices under left padding).
        key_mask: ``(batch, n_keys)`` bool, True for real tokens, by token index; None: no padding.
        rope, alibi, relative_bias: the stack's position block acting in attention, or None.
    """

    def __init__(self, start: int, seq_q: int, positions=None, key_mask=None, rope=None, alibi=None,
                 relative_bias=None):
        self.start, self.seq_q = start, seq_q
        self.positions = positions
        self.key_mask = key_mask
        self.rope, self.alibi, self.relative_bias = rope, alibi, relative_bias
        self._bias_memo: dict = {}

    def bias(self, first: int, seq_k: int, n_heads: int, device) -> torch.Tensor | None:
        """Additive ``(batch | 1, n_heads | 1, seq_q | 1, seq_k)`` bias for keys ``first .. first+seq_k``."""
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
        if self.relative_bias is not None:
            q_index = torch.arange(self.start, self.start + self.seq_q, device=device)
            k_index = torch.arange(first, first + seq_k, device=device)
            relative = self.relative_bias(q_index, k_index, n_heads).float()  # (1, n_heads, seq_q, seq_k)
            bias = relative if bias is None else bias + relative
        self._bias_memo[key] = bias
        return bias


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with ``n_heads`` query and ``n_kv_heads`` key/value heads.

    ``cross=True`` takes keys and values from ``memory`` (the encoder output) and applies no
    causal mask, window or position; otherwise keys and values come from ``x`` and the mask is
    causal when ``causal=True``.
    """

    def __init__(self, config, d_model: int, causal: bool = False, cross: bool = False, backend: str = "auto"):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.resolved_head_dim(d_model)
        self.causal = causal and not cross
        self.cross = cross
        self.sliding_window = None if cross else config.sliding_window
        self.scale = config.scale
        self.softcap = config.softcap
        self.dropout = config.dropout
        self.backend = backend
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=config.qkv_bias)
        self.out_proj = nn.Linear(q_dim, d_model, bias=config.out_bias)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n_heads: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        return proj(x).view(batch, seq, n_heads, self.head_dim).transpose(1, 2)  # (batch, heads, seq, head_dim)

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output, ``(batch, n_kv_heads, src, head_dim)``."""
        return self._heads(memory, self.k_proj, self.n_kv_heads), self._heads(memory, self.v_proj, self.n_kv_heads)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache=None, memory=None) -> torch.Tensor:
        """``x`` ``(batch, seq_q, d_model)`` -> ``(batch, seq_q, d_model)``."""
        batch, seq_q, _ = x.shape
        q = self._heads(x, self.q_proj, self.n_heads)  # (batch, n_heads, seq_q, head_dim)
        alibi = None
        if self.cross:
            if cache is not None and cache.memory is not None:
                k, v = cache.memory
            else:
                if memory is None:
                    raise ValueError("cross-attention needs the encoder output (memory)")
                k, v = self.project_memory(memory)
                if cache is not None:
                    cache.memory = (k, v)
            first = 0
        else:
            k = self._heads(x, self.k_proj, self.n_kv_heads)  # (batch, n_kv_heads, seq_q, head_dim)
            v = self._heads(x, self.v_proj, self.n_kv_heads)
            if inputs.rope is not None:
                q, k = inputs.rope(q, k, inputs.positions)
            first = inputs.start
            if cache is not None:
                k, v, first = cache.update(k, v)  # keys first .. first + seq_k, in token order
            if inputs.alibi is not None:
                alibi = inputs.alibi(self.n_heads, x.device)
        bias = inputs.bias(first, k.shape[2], self.n_heads, x.device)
        out = attention_kernel(
            q, k, v,
            causal=self.causal,
            sliding_window=self.sliding_window,
            alibi_slopes=alibi,
            bias=bias,
            softcap=self.softcap,
            scale=self.scale,
            backend=self.backend,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (batch, n_heads, seq_q, head_dim)
        out = out.transpose(1, 2).reshape(batch, seq_q, self.n_heads * self.head_dim)  # (batch, seq_q, n_heads * head_dim)
        return self.out_proj(out)
