"""One Transformer layer: self-attention, optional cross-attention and a feed-forward block,
each a residual sub-layer with its norms placed ``pre``, ``post`` or ``sandwich``.

With ``x`` the residual stream, ``f`` the sub-layer and ``drop`` the layer's dropout:

* ``pre``:      ``x + drop(f(norm(x)))``                  (GPT-2, Llama)
* ``post``:     ``norm(x + drop(f(x)))``                  (the 2017 Transformer, BERT)
* ``sandwich``: ``x + drop(post_norm(f(norm(x))))``       (Gemma 2)

The layer receives its built blocks (torchtune style) and builds nothing itself. Norm names:
``attention_norm``, ``cross_attention_norm``, ``ffn_norm`` (and ``*_post_norm`` for sandwich).
"""

from __future__ import annotations

import torch
from torch import nn

PLACEMENTS = ("pre", "post", "sandwich")


class TransformerLayer(nn.Module):
    def __init__(
        self,
        attention: nn.Module,
        ffn: nn.Module,
        norms: dict[str, nn.Module],
        *,
        cross_attention: nn.Module | None = None,
        placement: str = "pre",
        dropout: float = 0.0,
    ):
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"norm placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        self.attention = attention
        self.cross_attention = cross_attention
        self.ffn = ffn
        names = ["attention", "ffn"] + (["cross_attention"] if cross_attention is not None else [])
        needed = {f"{n}_norm" for n in names}
        if placement == "sandwich":
            needed |= {f"{n}_post_norm" for n in names}
        if set(norms) != needed:
            raise ValueError(f"a {placement}-norm layer needs norms {sorted(needed)}, got {sorted(norms)}")
        for name, norm in norms.items():
            self.add_module(name, norm)
        self.dropout = nn.Dropout(dropout)

    def _sublayer(self, x: torch.Tensor, name: str, fn) -> torch.Tensor:
        norm = getattr(self, f"{name}_norm")
        if self.placement == "pre":
            return x + self.dropout(fn(norm(x)))
        if self.placement == "post":
            return norm(x + self.dropout(fn(x)))
        return x + self.dropout(getattr(self, f"{name}_post_norm")(fn(norm(x))))

    def static_decode(self) -> str | None:
        """None when every attention sub-layer declares ``static_decode`` (it honours the static
        decoding step, ``blocks.cache``); else the class name of the first that does not."""
        for module in (self.attention, self.cross_attention):
            if module is not None and not getattr(module, "static_decode", False):
                return type(module).__name__
        return None

    def document_masking(self) -> str | None:
        """None when every attention sub-layer declares ``document_masking`` (it keeps a packed
        row's documents apart, ``blocks.attention``'s protocol); else the class name of the first
        that does not."""
        for module in (self.attention, self.cross_attention):
            if module is not None and not getattr(module, "document_masking", False):
                return type(module).__name__
        return None

    def new_cache(self, batch: int, max_tokens: int, dtype: torch.dtype, device) -> dict:
        """This layer's decoding caches, one per attention sub-layer (each block shapes its own)."""
        caches = {"attention": self.attention.new_cache(batch, max_tokens, dtype, device)}
        if self.cross_attention is not None:
            caches["cross_attention"] = self.cross_attention.new_cache(batch, max_tokens, dtype, device)
        return caches

    def forward(
        self, x: torch.Tensor, inputs, cache: dict | None = None, memory: torch.Tensor | None = None, memory_inputs=None
    ) -> torch.Tensor:
        """``x`` ``(batch, seq, d_model)``; ``inputs``/``memory_inputs``: ``AttentionInputs`` for
        self- and cross-attention; ``cache``: this layer's caches from :meth:`new_cache`, or None."""
        caches = cache or {}
        x = self._sublayer(x, "attention", lambda h: self.attention(h, inputs, cache=caches.get("attention")))
        if self.cross_attention is not None:
            x = self._sublayer(
                x,
                "cross_attention",
                lambda h: self.cross_attention(h, memory_inputs, cache=caches.get("cross_attention"), memory=memory),
            )
        return self._sublayer(x, "ffn", self.ffn)
