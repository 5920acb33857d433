"""What one attention call masks and adds to its scores, as one frozen value: :class:`Mask`.

Every backend of :func:`yamlformer.kernels.attention` reads the same value (the semantics of each
option are that module's doc): causal, a sliding window, chunks, ALiBi, an additive bias,
soft-capping, explicit token indices, packed documents and attention sinks. A caller builds one
``Mask`` and hands it on, and a step that changes what is masked (explicit token indices folded
into one additive bias for the PyTorch paths) makes a new one with :meth:`Mask.replace`: no mask
option travels as a loose positional argument. Only the ``yamlformer::flash_attention`` custom op
takes them flat, as ``torch.library`` requires of an op's schema
(``yamlformer.kernels.triton_attention.op_args``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: tensors compare by identity, not elementwise
class Mask:
    """The mask options of one attention call (``yamlformer.kernels.attention``'s module doc).

    Args:
        causal: mask keys after the query position.
        sliding_window: ``w``: a query sees keys at most ``w - 1`` positions back (itself
            included); combine with ``causal`` for Mistral-style windows.
        chunk_size: ``C``: a query sees only keys of its own chunk of ``C`` token positions
            (``pos_q // C == pos_k // C``), on top of the other masks. None: no chunks.
        alibi_slopes: ``(n_heads,)``; adds ``-slope_h * (pos_q - pos_k)`` to the scores.
        bias: additive, broadcastable to ``(batch, n_heads, seq_q, seq_k)`` (T5 relative bias,
            a padding mask with ``-inf``); receives a gradient when it requires one.
        softcap: ``c``: scores become ``c * tanh(scores / c)`` before bias and masks (Gemma 2).
        token_index: ``(query_index (seq_q,), key_index (seq_k,))`` long token indices that place
            the queries and keys for the masks and ALiBi; None: the usual layout.
        document_ids: ``(batch, seq_k)`` integer document of each key, non-decreasing along a
            row; a query (the last ``seq_q`` keys) sees only keys of its own document. Not with
            ``token_index``. None: one document per row.
        sinks: ``(n_heads,)`` float raw logits of a per-head sink column in the softmax; receives
            a gradient when it requires one. None: no sink.
    """

    causal: bool = False
    sliding_window: int | None = None
    chunk_size: int | None = None
    alibi_slopes: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    softcap: float | None = None
    token_index: tuple[torch.Tensor, torch.Tensor] | None = None
    document_ids: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    #: what a mask has besides ``causal``: its name in a tuning case key -> the option
    OPTIONS: ClassVar[dict[str, str]] = {
        "window": "sliding_window",
        "chunk": "chunk_size",
        "alibi": "alibi_slopes",
        "bias": "bias",
        "softcap": "softcap",
        "token_index": "token_index",
        "documents": "document_ids",
        "sinks": "sinks",
    }

    def present(self) -> dict[str, bool]:
        """Option name (``OPTIONS``' keys) -> whether this mask has it (``auto_backend``'s view)."""
        return {name: getattr(self, option) is not None for name, option in self.OPTIONS.items()}

    def replace(self, **changes) -> Mask:
        """This mask with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` int32 token index where each token's document begins, for
    ``document_ids`` ``(batch, seq)``: a document is a run of equal ids along the row
    (``[0, 0, 0, 1, 1, 2]`` -> ``[0, 0, 0, 3, 3, 5]``). Non-decreasing along every row."""
    batch, seq = document_ids.shape
    index = torch.arange(seq, dtype=torch.int32, device=document_ids.device).expand(batch, seq)
    begins = torch.cat(
        (torch.ones_like(document_ids[:, :1], dtype=torch.bool), document_ids[:, 1:] != document_ids[:, :-1]), dim=1
    )  # (batch, seq): a run's first token
    return torch.where(begins, index, 0).cummax(dim=1).values
