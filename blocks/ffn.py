"""Feed-forward blocks: MLP, gated linear units (SwiGLU, GeGLU) and mixture of experts.

Projection names follow Hugging Face's Llama/Mixtral (``gate_proj``, ``up_proj``,
``down_proj``; the MoE router is ``router``), so an importer maps weights by name. The MLP has
``up_proj`` and ``down_proj`` only. ``down_proj`` is the residual projection that
``blocks.init`` scales GPT-2 style.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blocks import registry

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact erf form (BERT, the 2017 Transformer's successors)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2, Gemma
    "silu": F.silu,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}") from None


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))``."""

    def __init__(self, config, d_model: int):
        super().__init__()
        hidden_dim = config.resolved_hidden_dim(d_model)
        self.up_proj = nn.Linear(d_model, hidden_dim, bias=config.bias)
        self.down_proj = nn.Linear(hidden_dim, d_model, bias=config.bias)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    def __init__(self, config, d_model: int):
        super().__init__()
        hidden_dim = config.resolved_hidden_dim(d_model)
        self.gate_proj = nn.Linear(d_model, hidden_dim, bias=config.bias)
        self.up_proj = nn.Linear(d_model, hidden_dim, bias=config.bias)
        self.down_proj = nn.Linear(hidden_dim, d_model, bias=config.bias)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k mixture of experts (Switch, Mixtral) with sparse dispatch.

    The router (a bias-free linear layer) scores every expert; each token goes to its ``top_k``
    experts with gates softmax-normalised over the chosen logits (equal to Mixtral's softmax
    over all experts, top-k, renormalise). Tokens are sorted by expert and each expert multiplies
    only its own rows, so the expert matmuls cover exactly ``top_k * tokens`` rows.

    After each forward, ``aux_loss`` holds the Switch/Mixtral load-balancing loss
    ``n_experts * sum_e f_e * P_e`` (``f_e``: share of tokens routed to expert ``e``, counting
    every one of a token's ``top_k`` choices; ``P_e``: the mean router probability of ``e``),
    differentiable through ``P_e``. It is computed over every token, padding included.
    """

    def __init__(self, config, d_model: int):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = nn.Linear(d_model, config.n_experts, bias=False)
        expert_class = registry.module_class(config.expert)
        self.experts = nn.ModuleList(expert_class(config.expert, d_model) for _ in range(config.n_experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (tokens, d_model)
        logits = self.router(flat)  # (tokens, n_experts)
        probs = torch.softmax(logits.float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)  # (tokens, top_k)
        gates = (top_probs / top_probs.sum(-1, keepdim=True)).to(x.dtype)

        choice_expert = top_experts.reshape(-1)  # (tokens * top_k,)
        order = torch.argsort(choice_expert, stable=True)
        counts = torch.bincount(choice_expert, minlength=self.n_experts)
        rows_token = order // self.top_k  # token of each sorted choice
        rows_gate = gates.reshape(-1)[order]
        out = torch.zeros_like(flat)
        start = 0
        for expert, n in zip(self.experts, counts.tolist()):
            if n:
                tokens = rows_token[start : start + n]
                y = expert(flat[tokens]) * rows_gate[start : start + n, None]
                out.index_add_(0, tokens, y)
                start += n

        routed_share = counts.float() / choice_expert.numel() * self.top_k  # f_e, summed over k
        self.aux_loss = self.n_experts * (routed_share * probs.mean(0)).sum()
        return out.reshape(shape)
