"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437, section 2.2) as a head, following the
head protocol of ``yamlformer.blocks.heads``; the fields, counts and the loss's definition are in
``yamlformer.blocks.configs.mtp``.

``forward(hidden, attention_mask, context)`` returns the main prediction's logits and, given a
context (a forward without a KV cache), ``{"mtp": loss}``: each module ``k`` (``mtp.{k-1}``) reads
the stack's embedding of the ids shifted ``k`` to the left (the embedding is the stack's module,
called, not copied: it stays shared) and runs its own layer over the stack's positions, padding
and packed documents (``context.inputs``), every position at once. The last ``k`` positions embed
wrapped-around ids; causal attention keeps them from the positions before, and their targets lie
beyond the window, so they take no part in the loss. A cached forward (decoding) is the main
prediction alone.

Names: ``proj`` (the shared output projection, tied to the embedding when the spec ties it),
``mtp.{k}.enorm``, ``.hnorm``, ``.eh_proj``, ``.layer`` (a ``yamlformer.blocks.layers.TransformerLayer``)
and ``.norm`` (Hugging Face's ``shared_head.norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from yamlformer.blocks.build import Dims, build_block, build_layer
from yamlformer.blocks.heads import IGNORE, HeadOutput, vocab_projection, vocabulary_logits
from yamlformer.blocks.linear import Linear


class MultiTokenPredictionModule(nn.Module):
    """One depth: ``layer(eh_proj([enorm(embedded); hnorm(h)]))`` (module doc)."""

    def __init__(self, layer, dims: Dims, *, layer_index: int, n_layers: int, backend: str):
        super().__init__()
        self.enorm = build_block(layer.norm, dims)
        self.hnorm = build_block(layer.norm, dims)
        self.eh_proj = Linear(2 * dims.d_model, dims.d_model, bias=False)
        self.layer = build_layer(layer, dims, layer_index=layer_index, n_layers=n_layers, causal=True, backend=backend)
        self.norm = build_block(layer.norm, dims)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, inputs) -> torch.Tensor:
        """``h^k`` ``(batch, seq, d_model)`` from ``h^(k-1)`` and the shifted tokens' embeddings."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))  # (batch, seq, d_model)
        return self.layer(x, inputs)


class MultiTokenPredictionHead(nn.Module):
    """The main prediction plus DeepSeek-V3's multi-token prediction modules (module doc)."""

    loss_names = ("mtp",)

    def __init__(
        self,
        config,
        d_model: int,
        vocab_size: int,
        max_seq_len: int,
        tied_embedding: nn.Embedding | None = None,
        n_layers: int = 0,
        backend: str = "auto",
        padded_vocab_size: int | None = None,
    ):
        super().__init__()
        self.proj = vocab_projection(d_model, padded_vocab_size or vocab_size, False, tied_embedding)
        self.vocab_size = vocab_size
        self.loss_weight = config.loss_weight
        dims, depth, layer = (
            Dims(d_model, vocab_size, max_seq_len),
            config.num_nextn_predict_layers,
            config.layer.layer(),
        )
        # the modules' layers count on after the stack's, as checkpoints number them
        self.mtp = nn.ModuleList(
            MultiTokenPredictionModule(
                layer, dims, layer_index=n_layers + k, n_layers=n_layers + depth, backend=backend
            )
            for k in range(depth)
        )

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, context=None) -> HeadOutput:
        logits = vocabulary_logits(self.proj(hidden), self.vocab_size)
        if context is None:
            return HeadOutput(logits, {})
        return HeadOutput(logits, {"mtp": self.loss(hidden, attention_mask, context)})

    def predictions(self, hidden: torch.Tensor, context) -> list[torch.Tensor]:
        """Each module's logits ``(batch, seq, vocab_size)``: at position ``t``, module ``k``'s
        prediction of token ``t + k + 1`` (meaningful where ``t + k + 1 < seq``)."""
        out = []
        for k, module in enumerate(self.mtp, start=1):
            hidden = module(hidden, context.embedding(torch.roll(context.input_ids, -k, dims=1)), context.inputs)
            out.append(vocabulary_logits(self.proj(module.norm(hidden)), self.vocab_size))
        return out

    def loss(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, context) -> torch.Tensor:
        """``loss_weight / D`` times the sum of the modules' mean cross-entropies (fp32)."""
        total = torch.zeros((), device=hidden.device)
        for k, logits in enumerate(self.predictions(hidden, context), start=1):
            targets = _targets(context.input_ids, k + 1, attention_mask, context.inputs.document_ids)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
            total = total + ce / (targets != IGNORE).sum().clamp(min=1)  # no target in the window: 0, not NaN
        return total * (self.loss_weight / len(self.mtp))


def _targets(ids: torch.Tensor, ahead: int, attention_mask, document_ids) -> torch.Tensor:
    """``(batch, seq)``: the token ``ahead`` places on, ``IGNORE`` past the window, on padding and
    across a packed document's end."""
    seq = ids.shape[1]
    target = torch.roll(ids, -ahead, dims=1)
    keep = (torch.arange(seq, device=ids.device) < seq - ahead).expand_as(ids)
    if attention_mask is not None:
        keep = keep & torch.roll(attention_mask.bool(), -ahead, dims=1)
    if document_ids is not None:
        keep = keep & (torch.roll(document_ids, -ahead, dims=1) == document_ids)
    return target.masked_fill(~keep, IGNORE)
