"""The modules of ``plugin_blocks`` (imported when a model is built, never to validate)."""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.cache import TensorCache
from yamlformer.blocks.linear import Linear
from yamlformer.blocks.positions import PositionModule
from yamlformer.kernels import Mask
from yamlformer.kernels import attention as attention_kernel


class LowRankKVAttention(nn.Module):
    """See ``plugin_blocks.LowRankKVConfig``. ``optimizer_steps`` counts ``after_optimizer_step``
    calls: a probe of that protocol (DeepSeek-V3's balancing bias is updated the same way)."""

    def __init__(self, config, d_model: int, causal: bool = False, cross: bool = False, backend: str = "auto"):
        super().__init__()
        if cross:
            raise ValueError("lowrank_kv cannot be a cross-attention")
        self.n_heads, self.kv_rank = config.n_heads, config.kv_rank
        self.head_dim, self.rope_dim, self.v_head_dim = config.head_dim, config.rope_dim, config.v_head_dim
        self.causal, self.backend = causal, backend
        n = self.n_heads
        self.q_proj = Linear(d_model, n * (self.head_dim + self.rope_dim), bias=False)
        self.kv_down = Linear(d_model, self.kv_rank + self.rope_dim, bias=False)
        self.kv_up = Linear(self.kv_rank, n * (self.head_dim + self.v_head_dim), bias=False)
        self.out_proj = Linear(n * self.v_head_dim, d_model, bias=False)
        self.cache_layout = config.kv_cache(d_model)
        self.register_buffer("optimizer_steps", torch.zeros((), dtype=torch.long))

    def after_optimizer_step(self) -> None:
        self.optimizer_steps += 1

    def new_cache(self, batch: int, max_tokens: int, dtype: torch.dtype, device) -> TensorCache:
        return TensorCache(self.cache_layout, batch, max_tokens, dtype, device)

    def forward(self, x: torch.Tensor, inputs, cache=None, memory=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        n = self.n_heads
        q = self.q_proj(x).view(batch, seq, n, self.head_dim + self.rope_dim).transpose(1, 2)  # (batch, n, seq, qk)
        q_pass, q_rot = q.split([self.head_dim, self.rope_dim], dim=-1)
        kv = self.kv_down(x)  # (batch, seq, kv_rank + rope_dim)
        latent = kv[..., : self.kv_rank][:, None]  # (batch, 1, seq, kv_rank)
        k_rot = kv[..., self.kv_rank :][:, None]  # (batch, 1, seq, rope_dim): one key part for every head
        q_rot, k_rot = inputs.rotate(q_rot, k_rot)
        first = inputs.start
        if cache is not None:
            latent, k_rot, first = cache.update(latent, k_rot)  # every cached position, in token order
        seq_k = latent.shape[2]
        expanded = self.kv_up(latent[:, 0]).view(batch, seq_k, n, self.head_dim + self.v_head_dim).transpose(1, 2)
        k_pass, v = expanded.split([self.head_dim, self.v_head_dim], dim=-1)  # (batch, n, seq_k, .)
        k = torch.cat((k_pass, k_rot.expand(batch, n, seq_k, self.rope_dim)), dim=-1)
        slopes, bias = inputs.alibi_slopes(n, x.device), inputs.bias(first, seq_k, n, x.device)
        mask = Mask(causal=self.causal, alibi_slopes=slopes, bias=bias)
        out = attention_kernel(
            torch.cat((q_pass, q_rot), dim=-1), k, v, mask, backend=self.backend
        )  # (batch, n, seq, v_head_dim)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, n * self.v_head_dim))


class InterleavedRope(PositionModule):
    """Rotates pairs ``(x[2i], x[2i+1])`` by ``position * theta^(-2i/width)``."""

    def __init__(self, config):
        super().__init__(config)
        self.theta = config.theta

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return self(q, k, positions)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        width = q.shape[-1]
        exponents = torch.arange(0, width, 2, device=q.device, dtype=torch.float32) / width
        angles = positions.float()[..., None] * self.theta**-exponents  # (batch, seq, width / 2)
        cos = angles.cos().repeat_interleave(2, dim=-1)[:, None].to(q.dtype)  # (batch, 1, seq, width)
        sin = angles.sin().repeat_interleave(2, dim=-1)[:, None].to(q.dtype)

        def rotate(x):
            pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
            return x * cos + pairs * sin

        return rotate(q), rotate(k)
