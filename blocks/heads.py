"""Output heads: language model, BERT masked LM, sequence classification, none; and the head
protocol every head follows.

The protocol (what the architectures in ``yamlformer.blocks.stacks`` ask of a head):

* ``forward(hidden, attention_mask=None, context=None) -> HeadOutput``: ``hidden`` the final
  hidden states ``(batch, seq, d_model)`` of the stack that feeds the head, ``attention_mask``
  its padding (1 real, 0 pad) over those positions; ``context`` a :class:`HeadContext` on every
  forward without a KV cache (training, evaluation), None on a cached one (decoding), where a
  head computes its logits only. :class:`HeadOutput` holds the logits and a dict of auxiliary
  training losses, each already weighted by the head's own spec field (none for these heads);
* ``loss_names``: the names of those losses (empty: the head returns none), known before any
  forward so a training loop knows it has losses to add;
* optional ``per_position = True``: each position's logits depend on that position's hidden state
  alone (no mask, no context, no losses), so a model may hand the head only the positions a loss
  scores, ``hidden`` ``(n, d_model)`` -> logits ``(n, vocab_size)`` (the model's ``scored``:
  instruction data's answers, the masked tokens of MLM), and skip the others' projection.

A head whose output projection is tied to the token embedding gets that ``nn.Embedding`` as
``tied_embedding`` and shares its weight parameter (counted once).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch
from torch import nn

from yamlformer.blocks.ffn import activation
from yamlformer.blocks.linear import Linear
from yamlformer.blocks.norms import LayerNorm

#: a target id that takes no part in a loss (padding, unmasked MLM positions, past a window):
#: PyTorch's default ``ignore_index``; every loss and every batch of targets uses this one
IGNORE = -100


class HeadOutput(NamedTuple):
    """What a head returns: ``logits`` (``(batch, seq, vocab_size)``, ``(batch, n_classes)``, or
    the hidden states for head ``none``) and ``losses``, auxiliary training losses by name, each
    already weighted (a multi-token-prediction loss times its ``loss_weight``)."""

    logits: torch.Tensor
    losses: dict[str, torch.Tensor]


@dataclasses.dataclass
class HeadContext:
    """What a head is given beside the hidden states, on a forward without a KV cache.

    ``input_ids`` ``(batch, seq)``: the tokens of the stack that feeds the head; ``embedding``:
    that stack's ``yamlformer.blocks.embeddings.Embeddings`` (call it, ``embedding(ids)``, for a shared
    embedding: its own parameters stay where they are); ``inputs``: the stack's
    ``yamlformer.blocks.attention.AttentionInputs`` of this forward (positions, padding, packed documents,
    the position block's hooks), for a layer the head runs over the same positions."""

    input_ids: torch.Tensor
    embedding: nn.Module
    inputs: object


def vocab_projection(d_model: int, vocab_size: int, bias: bool, tied_embedding: nn.Embedding | None) -> Linear:
    """The ``(vocab_size, d_model)`` output projection, its weight the embedding's when tied
    (``vocab_size``: the rows, a padded vocabulary's when the spec pads it)."""
    if tied_embedding is None:
        return Linear(d_model, vocab_size, bias=bias)
    if tuple(tied_embedding.weight.shape) != (vocab_size, d_model):
        raise ValueError(
            f"cannot tie a ({vocab_size}, {d_model}) output projection to an embedding of shape "
            f"{tuple(tied_embedding.weight.shape)}"
        )
    with warnings.catch_warnings():  # "initializing zero-element tensors is a no-op"
        warnings.simplefilter("ignore", UserWarning)
        proj = Linear(d_model, 0, bias=False)  # an empty weight, replaced by the shared one
    proj.out_features = vocab_size
    proj.weight = tied_embedding.weight
    if bias:
        weight = tied_embedding.weight
        proj.bias = nn.Parameter(torch.zeros(vocab_size, device=weight.device, dtype=weight.dtype))
    return proj


def vocabulary_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits`` of a padded vocabulary's projection without the padded ids' columns (the spec's
    ``pad_vocab_to_multiple_of``), so no loss or sampling ever sees them; as they are otherwise."""
    return logits[..., :vocab_size] if logits.shape[-1] != vocab_size else logits


class VocabularyHead(nn.Module):
    """What a head projecting to the vocabulary shares: its ``(rows, d_model)`` projection (the
    spec's ``padded_vocab_size`` rows when it pads its vocabulary, the embedding's table when tied)
    built after the head's own layers (:meth:`layers`), and the padded ids' logits cut off."""

    loss_names: tuple[str, ...] = ()

    def __init__(
        self,
        config,
        d_model: int,
        vocab_size: int,
        tied_embedding: nn.Embedding | None = None,
        padded_vocab_size: int | None = None,
    ):
        super().__init__()
        bias = self.layers(config, d_model)
        self.proj = vocab_projection(d_model, padded_vocab_size or vocab_size, bias, tied_embedding)
        self.vocab_size = vocab_size

    def layers(self, config, d_model: int) -> bool:
        """Build what comes before the projection; whether the projection has a bias."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The projection's logits of the vocabulary's ids (a padded vocabulary's cut off)."""
        return vocabulary_logits(self.proj(hidden), self.vocab_size)


class LMHead(VocabularyHead):
    """``softcap(proj(hidden * output_scale))``: vocabulary logits ``(batch, seq, vocab_size)``."""

    per_position = True  # (module doc)

    def layers(self, config, d_model: int) -> bool:
        self.output_scale = config.output_scale
        self.softcap = config.softcap
        return config.bias

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, context=None) -> HeadOutput:
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        logits = self.logits(hidden)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return HeadOutput(logits, {})


class MLMHead(VocabularyHead):
    """BERT's masked-LM head: ``proj(norm(act(dense(hidden))))``, the projection with a bias."""

    per_position = True  # (module doc)

    def layers(self, config, d_model: int) -> bool:
        self.dense = Linear(d_model, d_model)
        self.act = activation(config.activation)
        self.norm = LayerNorm(config.norm, d_model)
        return True

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, context=None) -> HeadOutput:
        return HeadOutput(self.logits(self.norm(self.act(self.dense(hidden)))), {})


class ClassificationHead(nn.Module):
    """Pools the sequence (``first`` token or masked ``mean``), optionally through BERT's
    ``tanh(dense(.))`` pooler, then dropout and a linear classifier: ``(batch, n_classes)``."""

    loss_names: tuple[str, ...] = ()

    def __init__(self, config, d_model: int):
        super().__init__()
        self.pooling = config.pooling
        self.pooler = Linear(d_model, d_model) if config.pooler else None
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = Linear(d_model, config.n_classes)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, context=None) -> HeadOutput:
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
        return HeadOutput(self.classifier(self.dropout(pooled)), {})


class NoHead(nn.Module):
    """No head: returns the final hidden states ``(batch, seq, d_model)``."""

    loss_names: tuple[str, ...] = ()

    def __init__(self, config):
        super().__init__()

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, context=None) -> HeadOutput:
        return HeadOutput(hidden, {})
