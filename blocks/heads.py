"""Output heads: language model, BERT masked LM, sequence classification, none.

Every head's ``forward(hidden, attention_mask=None)`` takes the final hidden states
``(batch, seq, d_model)``. A head whose output projection is tied to the token embedding gets
that ``nn.Embedding`` as ``tied_embedding`` and shares its weight parameter (counted once).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from blocks.ffn import activation
from blocks.norms import LayerNorm


def _vocab_projection(d_model: int, vocab_size: int, bias: bool, tied_embedding: nn.Embedding | None) -> nn.Linear:
    if tied_embedding is None:
        return nn.Linear(d_model, vocab_size, bias=bias)
    if tuple(tied_embedding.weight.shape) != (vocab_size, d_model):
        raise ValueError(
            f"cannot tie a ({vocab_size}, {d_model}) output projection to an embedding of shape "
            f"{tuple(tied_embedding.weight.shape)}"
        )
    with warnings.catch_warnings():  # "initializing zero-element tensors is a no-op"
        warnings.simplefilter("ignore", UserWarning)
        proj = nn.Linear(d_model, 0, bias=False)  # an empty weight, replaced by the shared one
    proj.out_features = vocab_size
    proj.weight = tied_embedding.weight
    if bias:
        weight = tied_embedding.weight
        proj.bias = nn.Parameter(torch.zeros(vocab_size, device=weight.device, dtype=weight.dtype))
    return proj


class LMHead(nn.Module):
    """``softcap(proj(hidden * output_scale))``: vocabulary logits ``(batch, seq, vocab_size)``."""

    def __init__(self, config, d_model: int, vocab_size: int, tied_embedding: nn.Embedding | None = None):
        super().__init__()
        self.proj = _vocab_projection(d_model, vocab_size, config.bias, tied_embedding)
        self.output_scale = config.output_scale
        self.softcap = config.softcap

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        logits = self.proj(hidden)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


class MLMHead(nn.Module):
    """BERT's masked-LM head: ``proj(norm(act(dense(hidden))))``, the projection with a bias."""

    def __init__(self, config, d_model: int, vocab_size: int, tied_embedding: nn.Embedding | None = None):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.act = activation(config.activation)
        self.norm = LayerNorm(config.norm, d_model)
        self.proj = _vocab_projection(d_model, vocab_size, True, tied_embedding)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.norm(self.act(self.dense(hidden))))


class ClassificationHead(nn.Module):
    """Pools the sequence (``first`` token or masked ``mean``), optionally through BERT's
    ``tanh(dense(.))`` pooler, then dropout and a linear classifier: ``(batch, n_classes)``."""

    def __init__(self, config, d_model: int):
        super().__init__()
        self.pooling = config.pooling
        self.pooler = nn.Linear(d_model, d_model) if config.pooler else None
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(d_model, config.n_classes)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pooling == "first":
            pooled = hidden[:, 0]  # (batch, d_model)
        else:
            if attention_mask is None:
                pooled = hidden.mean(dim=1)
            else:
                keep = attention_mask[..., None].to(hidden.dtype)  # (batch, seq, 1)
                pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)  # (batch, d_model)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return self.classifier(self.dropout(pooled))


class NoHead(nn.Module):
    """No head: returns the final hidden states ``(batch, seq, d_model)``."""

    def __init__(self, config):
        super().__init__()

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return hidden
