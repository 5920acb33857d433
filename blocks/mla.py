"""Multi-head latent attention (DeepSeek-V2/V3), following the attention module protocol of
``yamlformer.blocks.attention``; the fields and counts are in ``yamlformer.blocks.configs.mla``.

Two ways through the same weights:

* **Without a cache** (training, a full forward): the latent is expanded by ``kv_b_proj`` into
  every head's key and value, and ``yamlformer.kernels.attention`` scores ``qk_nope + qk_rope``-wide heads
  and mixes ``v_head_dim``-wide values (DeepSeek's "naive" path; what the FLOP count counts).
* **With a cache** (decoding): the cache holds ``[normalised latent | rotated shared key]``
  per token, one ``kv_lora_rank + qk_rope_head_dim`` vector, and is never expanded. The key
  half of ``kv_b_proj`` is absorbed into the query (``q_nope @ W_UK``, per head) and the value
  half into the output (``out_latent @ W_UV^T``), so attention runs as multi-query attention
  over the cache itself: one key/value head whose keys are the cached vectors and whose values
  are their latent part (a view, not a copy). This is DeepSeek's ``attn_impl="absorb"``.

Routing: the absorbed heads are ``kv_lora_rank + qk_rope_head_dim`` wide (576 in V2/V3), wider
than the 256 the Triton kernels tile, so those calls go to ``auto`` (SDPA) when the module was
built for ``triton``; smaller latents (tests, small models) stay on Triton. Training shapes
(192-wide scores, 128-wide values) run on every backend.

Weight names are Hugging Face's (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``...),
except ``out_proj`` (their ``o_proj``), the residual projection ``yamlformer.blocks.init`` scales.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.cache import TensorCache
from yamlformer.blocks.linear import Linear
from yamlformer.blocks.norms import RMSNorm
from yamlformer.kernels import Mask
from yamlformer.kernels import attention as attention_kernel
from yamlformer.kernels.attention import MAX_TRITON_HEAD_DIM


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's MLA as a causal (or bidirectional) self-attention; see the module doc."""

    static_decode = True  # honours AttentionInputs.index (yamlformer.blocks.attention's protocol)
    document_masking = True  # honours AttentionInputs.document_ids (the same protocol)

    def __init__(self, config, d_model: int, causal: bool = False, cross: bool = False, backend: str = "auto"):
        super().__init__()
        if cross:
            raise ValueError("mla is a self-attention; give the stack a multi_head cross_attention")
        self.n_heads = config.n_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.causal = causal
        self.scale = config.scale if config.scale is not None else config.qk_head_dim**-0.5
        self.dropout = config.dropout
        self.backend = backend
        self.cache_layout = config.kv_cache(d_model)
        qk_dim, norm = self.n_heads * config.qk_head_dim, config.latent_norm()
        if config.q_lora_rank is None:
            self.q_proj = Linear(d_model, qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(d_model, config.q_lora_rank, bias=config.bias)
            self.q_a_layernorm = RMSNorm(norm, config.q_lora_rank)
            self.q_b_proj = Linear(config.q_lora_rank, qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d_model, self.kv_lora_rank + self.rope, bias=config.bias)
        self.kv_a_layernorm = RMSNorm(norm, self.kv_lora_rank)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.out_proj = Linear(self.n_heads * self.v_dim, d_model, bias=config.bias)

    def new_cache(self, batch: int, max_tokens: int, dtype: torch.dtype, device) -> TensorCache:
        """The latent cache: ``(batch, 1, positions, kv_lora_rank + qk_rope_head_dim)``."""
        return TensorCache(self.cache_layout, batch, max_tokens, dtype, device)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)  # (batch, heads, seq, qk)

    def forward(self, x: torch.Tensor, inputs, cache=None, memory=None) -> torch.Tensor:
        """``x`` ``(batch, seq, d_model)`` -> ``(batch, seq, d_model)``."""
        batch, seq, _ = x.shape
        q_nope, q_rope = self._query(x).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (batch, seq, kv_lora_rank)
        q_rope, k_rope = inputs.rotate(q_rope, k_rope[:, None])  # k_rope: (batch, 1, seq, rope), all heads'
        mask = Mask(
            causal=self.causal,
            alibi_slopes=inputs.alibi_slopes(self.n_heads, x.device),
            document_ids=inputs.document_ids,
        )
        scale = self.scale * inputs.score_scale()
        if cache is None:
            out = self._expanded(q_nope, q_rope, latent, k_rope, inputs, mask, scale)
        else:
            out = self._absorbed(q_nope, q_rope, latent, k_rope, inputs, cache, mask, scale)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (batch, seq, heads * v)
        return self.out_proj(out)

    def _expanded(self, q_nope, q_rope, latent, k_rope, inputs, mask: Mask, scale: float) -> torch.Tensor:
        """Every head's key and value from the latent (training, full forward)."""
        batch, seq, _ = latent.shape
        kv = self.kv_b_proj(latent).view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (batch, heads, seq, nope), (..., v)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (batch, heads, seq, nope + rope)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # (batch, heads, seq, nope + rope)
        bias = inputs.bias(inputs.start, seq, self.n_heads, latent.device)
        dropout = self.dropout if self.training else 0.0
        return attention_kernel(q, k, v, mask.replace(bias=bias), scale=scale, backend=self.backend, dropout_p=dropout)

    def _absorbed(self, q_nope, q_rope, latent, k_rope, inputs, cache, mask: Mask, scale: float) -> torch.Tensor:
        """Multi-query attention over the cached latents, ``kv_b_proj`` folded into q and out."""
        entry = torch.cat((latent[:, None], k_rope), dim=-1)  # (batch, 1, seq, kv_lora_rank + rope)
        cached, first = cache.update(entry, index=inputs.index)  # (batch, 1, keys, kv_lora_rank + rope)
        # the weight kv_b_proj applies: an adapter's change folded in, an NF4 base dequantized
        weight = self.kv_b_proj.adapted_weight().view(-1, self.nope + self.v_dim, self.kv_lora_rank)
        w_key, w_value = weight.split([self.nope, self.v_dim], dim=1)  # (heads, nope, rank), (heads, v, rank)
        q = torch.cat((torch.matmul(q_nope, w_key), q_rope), dim=-1)  # (batch, heads, seq, rank + rope)
        values = cached[..., : self.kv_lora_rank]  # (batch, 1, keys, rank), a view
        bias = inputs.bias(first, cached.shape[2], self.n_heads, q.device)
        backend = self.backend
        if backend == "triton" and q.shape[-1] > MAX_TRITON_HEAD_DIM:
            backend = "auto"  # the 576-wide latent heads of V2/V3 exceed the Triton tiles (module doc)
        mask = mask.replace(bias=bias, token_index=inputs.token_index(first))
        out = attention_kernel(q, cached, values, mask, scale=scale, backend=backend)  # (batch, heads, seq, rank)
        return torch.matmul(out, w_value.transpose(1, 2))  # (batch, heads, seq, v)
