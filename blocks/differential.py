"""Differential attention (Ye et al. 2024, arXiv:2410.05258), following the attention module
protocol of ``yamlformer.blocks.attention``; the fields, counts and the paper's rule are in
``yamlformer.blocks.configs.differential``.

The query and key projections hold ``2 * n_heads`` and ``2 * n_kv_heads`` half-heads of
``head_dim``, the two halves of head ``h`` side by side (half-heads ``2h`` and ``2h + 1``, as the
paper's code lays them out); the value projection ``n_kv_heads`` heads of ``2 * head_dim``. The
position block rotates every half-head as a head. The two maps are two ``yamlformer.kernels.attention``
calls over the same values, ``A1 V - lambda * A2 V`` being ``(A1 - lambda * A2) V``, so every
backend, mask, the KV cache (both key halves cached as ``2 * n_kv_heads`` heads) and the static
decoding step work as they do for ``multi_head``.

``lambda`` and the norm weight are shared by the layer's heads. Under tensor parallelism each
rank computes a share of the heads, so each rank's gradient of them is a partial sum:
``use_tensor_parallel`` makes the forward pass them through an identity whose backward sums the
gradient over the tensor-parallel group (Megatron's copy-to-region), keeping every rank's copy
equal.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.cache import TensorCache
from yamlformer.blocks.configs.differential import LAMBDAS
from yamlformer.blocks.linear import Linear
from yamlformer.blocks.tensor_parallel import shared
from yamlformer.kernels import Mask
from yamlformer.kernels import attention as attention_kernel

#: the paper's initial spread of the lambda vectors (its code: normal(0, 0.1))
LAMBDA_STD = 0.1


class DifferentialAttention(nn.Module):
    """Differential attention as a causal (or bidirectional) self-attention; see the module doc."""

    static_decode = True  # honours AttentionInputs.index (yamlformer.blocks.attention's protocol)
    document_masking = True  # honours AttentionInputs.document_ids (the same protocol)

    def __init__(
        self,
        config,
        d_model: int,
        causal: bool = False,
        cross: bool = False,
        backend: str = "auto",
        layer_index: int = 0,
    ):
        super().__init__()
        if cross:
            raise ValueError("differential is a self-attention; give the stack a multi_head cross_attention")
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = hd = config.resolved_head_dim(d_model)
        self.causal, self.sliding_window, self.backend = causal, config.sliding_window, backend
        self.lambda_init = config.resolved_lambda_init(layer_index)  # the layer's place sets it
        self.eps = config.norm_eps
        self.scale = config.scale if config.scale is not None else hd**-0.5
        self.cache_layout = config.kv_cache(d_model)
        self.first_head, self.total_heads = 0, self.n_heads  # this module's heads among the layer's
        self.group = None  # the tensor-parallel group the shared tensors' gradients sum over
        self.q_proj = Linear(d_model, 2 * self.n_heads * hd, bias=False)
        self.k_proj = Linear(d_model, 2 * self.n_kv_heads * hd, bias=False)
        self.v_proj = Linear(d_model, 2 * self.n_kv_heads * hd, bias=False)
        self.out_proj = Linear(2 * self.n_heads * hd, d_model, bias=False)
        for name in LAMBDAS:
            self.register_parameter(name, nn.Parameter(torch.zeros(hd)))
        self.subln = _HeadNormWeight(2 * hd)

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return dict.fromkeys(LAMBDAS, ("normal", LAMBDA_STD))

    def use_tensor_parallel(self, rank: int, degree: int) -> None:
        """This rank's share of the heads (the plan split the projections by head); lambda's and
        the norm weight's gradients summed over the group from now on (module doc)."""
        self.n_heads //= degree
        self.n_kv_heads //= degree
        self.first_head = rank * self.n_heads
        mesh = getattr(self.q_proj.weight, "device_mesh", None)  # a DTensor once the plan applied
        self.group = mesh.get_group() if mesh is not None else None

    def _shared(self, t: torch.Tensor) -> torch.Tensor:
        return shared(t, self.group)

    def new_cache(self, batch: int, max_tokens: int, dtype: torch.dtype, device) -> TensorCache:
        """Both key halves and the values for decoding, as the config's ``kv_cache`` lays them out."""
        return TensorCache(self.cache_layout, batch, max_tokens, dtype, device)

    def lambda_full(self) -> torch.Tensor:
        """``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``, a 0-d fp32 tensor."""
        q1, k1, q2, k2 = (getattr(self, name).float() for name in LAMBDAS)
        return torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + self.lambda_init

    def forward(self, x: torch.Tensor, inputs, cache=None, memory=None) -> torch.Tensor:
        """``x`` ``(batch, seq, d_model)`` -> ``(batch, seq, d_model)``."""
        batch, seq, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(batch, seq, 2 * self.n_heads, hd).transpose(1, 2)  # (batch, 2 heads, seq, hd)
        k = self.k_proj(x).view(batch, seq, 2 * self.n_kv_heads, hd).transpose(1, 2)  # (batch, 2 kv, seq, hd)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, 2 * hd).transpose(1, 2)  # (batch, kv, seq, 2 hd)
        q, k = inputs.rotate(q, k)
        first = inputs.start
        if cache is not None:  # keys first .. first + seq_k in token order (a static step: every slot)
            k, v, first = cache.update(k, v, index=inputs.index)
        bias = inputs.bias(first, k.shape[2], self.total_heads, x.device)
        if bias is not None and bias.shape[1] > self.n_heads:  # (batch | 1, total_heads, ...): this rank's heads
            bias = bias[:, self.first_head : self.first_head + self.n_heads]
        slopes = inputs.alibi_slopes(self.total_heads, x.device)
        mask = Mask(
            causal=self.causal,
            sliding_window=self.sliding_window,
            alibi_slopes=slopes[self.first_head : self.first_head + self.n_heads] if slopes is not None else None,
            bias=bias,
            token_index=inputs.token_index(first),
            document_ids=inputs.document_ids,
        )
        options = dict(scale=self.scale * inputs.score_scale(), backend=self.backend)
        first_map = attention_kernel(q[:, 0::2], k[:, 0::2], v, mask, **options)  # (batch, heads, seq, 2 hd)
        second_map = attention_kernel(q[:, 1::2], k[:, 1::2], v, mask, **options)
        lam = self._shared(self.lambda_full().to(second_map.dtype))
        out = _rms(first_map - lam * second_map, self._shared(self.subln.weight), self.eps)
        out = out * (1.0 - self.lambda_init)
        out = out.transpose(1, 2).reshape(batch, seq, 2 * self.n_heads * hd)  # (batch, seq, heads * 2 hd)
        return self.out_proj(out)


class _HeadNormWeight(nn.Module):
    """The per-head norm's weight (``subln.weight``, the paper's name), initialised to 1."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"weight": ("constant", 1.0)}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim in fp32 (as ``yamlformer.blocks.norms.RMSNorm``), with a weight passed in."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
