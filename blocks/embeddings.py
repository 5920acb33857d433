"""Token embeddings: the token table, optional segment (token-type) table, scale, norm, dropout.

``forward`` sums ``tokens(ids) * scale + positions + segments(token_type_ids)``, then applies
the embedding norm (BERT) and dropout. Absolute position embeddings (sinusoidal, learned) are
computed by the stack's position block and passed in.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Embeddings(nn.Module):
    """``tokens`` is an ``nn.Embedding(vocab_size, d_model)``; ``segments`` one of
    ``(segments, d_model)`` when the spec asks for token types; ``norm`` a built norm or None."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        scale: str = "none",
        segments: int = 0,
        norm: nn.Module | None = None,
        dropout: float = 0.0,
        scale_in_model_dtype: bool = False,
    ):
        super().__init__()
        if scale not in ("none", "sqrt_d"):
            raise ValueError(f"embedding scale must be none or sqrt_d, got {scale!r}")
        # Uninitialised tables (yamlformer.blocks.init fills them): nn.Embedding's own normal_ init would
        # cost a second on the meta device, the first time a process runs it there.
        self.tokens = _table(vocab_size, d_model)
        self.segments = _table(segments, d_model) if segments else None
        self.scale = math.sqrt(d_model) if scale == "sqrt_d" else None
        self.scale_in_model_dtype = scale_in_model_dtype  # Gemma: the factor rounded to bf16 first
        self.norm = norm
        self.dropout = nn.Dropout(dropout)
        self.vocab_size = vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        position_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        table = self.tokens.weight
        if input_ids.device != table.device and table.device.type != "meta":
            raise ValueError(
                f"input_ids are on {input_ids.device}, the model on {table.device}; "
                f"move them first: input_ids.to({str(table.device)!r})"
            )
        x = _lookup(self.tokens, input_ids, "input_ids", "the vocabulary")  # (batch, seq, d_model)
        if self.scale is not None:
            x = x * (torch.tensor(self.scale, dtype=x.dtype) if self.scale_in_model_dtype else self.scale)
        if position_embeddings is not None:
            x = x + position_embeddings.to(x.dtype)
        if token_type_ids is not None:
            if self.segments is None:
                raise ValueError("token_type_ids given but the spec has no segment table (embedding.segments: 0)")
            x = x + _lookup(self.segments, token_type_ids, "token_type_ids", "the segment table")
        elif self.segments is not None:
            x = x + self.segments.weight[0]  # type 0 everywhere, as BERT defaults
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def _lookup(table: nn.Embedding, ids: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """``table(ids)``, an id outside the table being a ``ValueError`` that says the range. Free: on
    the CPU the lookup's own IndexError is turned into it; on a GPU an id out of range stops the
    kernel with a device-side assert (checking first would cost a synchronisation per forward;
    ``generate`` checks its prompt)."""
    try:
        return table(ids)
    except IndexError:
        rows = table.num_embeddings
        bad = ids[(ids < 0) | (ids >= rows)]
        shown = f" (e.g. {int(bad[0])})" if bad.numel() else ""
        raise ValueError(f"{name} holds ids outside {what}{shown}: ids must be in [0, {rows - 1}]") from None


def _table(rows: int, d_model: int) -> nn.Embedding:
    return nn.Embedding.from_pretrained(torch.empty(rows, d_model), freeze=False)
