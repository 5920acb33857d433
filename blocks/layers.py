"""One Transformer layer: self-attention, optional cross-attention and a feed-forward block,
each a residual sub-layer with its norms placed ``pre``, ``post``, ``sandwich`` or
``post_sublayer``, run in sequence or in parallel.

With ``x`` the residual stream, ``f`` the sub-layer and ``drop`` the layer's dropout:

* ``pre``:           ``x + drop(f(norm(x)))``                  (GPT-2, Llama)
* ``post``:          ``norm(x + drop(f(x)))``                  (the 2017 Transformer, BERT)
* ``sandwich``:      ``x + drop(post_norm(f(norm(x))))``       (Gemma 2)
* ``post_sublayer``: ``x + drop(norm(f(x)))``                  (OLMo 2)

In sequence each sub-layer reads the previous one's result. ``parallel_residual`` true: every
sub-layer reads the layer's input ``x`` and the layer returns ``x`` plus each sub-layer's
``drop(...)`` term above, ``x + drop(attn(attention_norm(x))) + drop(ffn(ffn_norm(x)))`` with
``pre`` (GPT-NeoX); ``shared_norm``: one norm, ``h = attention_norm(x)``, feeds them all,
``x + drop(attn(h)) + drop(ffn(h))`` (GPT-J, Falcon). ``post`` has no parallel form.

The layer receives its built blocks (torchtune style) and builds nothing itself. Norm names:
``attention_norm``, ``cross_attention_norm``, ``ffn_norm`` (and ``*_post_norm`` for sandwich;
post_sublayer's norms take the plain names: Hugging Face's OLMo 2 ``post_attention_layernorm``
is ``attention_norm``, its ``post_feedforward_layernorm`` ``ffn_norm``); a shared_norm layer has
``attention_norm`` only.
"""

from __future__ import annotations

import torch
from torch import nn

PLACEMENTS = ("pre", "post", "sandwich", "post_sublayer")
PARALLEL = (False, True, "shared_norm")


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
        parallel_residual: bool | str = False,
    ):
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"norm placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if parallel_residual not in PARALLEL:
            raise ValueError(f"parallel_residual must be false, true or 'shared_norm', got {parallel_residual!r}")
        if parallel_residual == "shared_norm" and placement != "pre":
            raise ValueError(f"parallel_residual shared_norm needs norm placement pre, got {placement!r}")
        if parallel_residual is True and placement == "post":
            raise ValueError("parallel_residual needs a norm inside each branch; placement post has none")
        self.placement, self.parallel_residual = placement, parallel_residual
        self.attention = attention
        self.cross_attention = cross_attention
        self.ffn = ffn
        names = ["attention", "ffn"] + (["cross_attention"] if cross_attention is not None else [])
        needed = {f"{n}_norm" for n in names}
        if placement == "sandwich":
            needed |= {f"{n}_post_norm" for n in names}
        if parallel_residual == "shared_norm":
            needed = {"attention_norm"}
        if set(norms) != needed:
            kind = "shared_norm parallel" if parallel_residual == "shared_norm" else f"{placement}-norm"
            raise ValueError(f"a {kind} layer needs norms {sorted(needed)}, got {sorted(norms)}")
        for name, norm in norms.items():
            self.add_module(name, norm)
        self.dropout = nn.Dropout(dropout)

    def _branch(self, x: torch.Tensor, name: str, fn) -> torch.Tensor:
        """The sub-layer's term added to the residual (pre, sandwich, post_sublayer), ``x`` its
        input (already normed in a shared_norm layer)."""
        if self.parallel_residual == "shared_norm":
            return self.dropout(fn(x))
        norm = getattr(self, f"{name}_norm")
        if self.placement == "pre":
            return self.dropout(fn(norm(x)))
        if self.placement == "post_sublayer":
            return self.dropout(norm(fn(x)))
        return self.dropout(getattr(self, f"{name}_post_norm")(fn(norm(x))))

    def _sublayer(self, x: torch.Tensor, name: str, fn) -> torch.Tensor:
        if self.placement == "post":
            return getattr(self, f"{name}_norm")(x + self.dropout(fn(x)))
        return x + self._branch(x, name, fn)

    def static_decode(self) -> str | None:
        """None when every attention sub-layer declares ``static_decode`` (it honours the static
        decoding step, ``yamlformer.blocks.cache``); else the class name of the first that does not."""
        for module in (self.attention, self.cross_attention):
            if module is not None and not getattr(module, "static_decode", False):
                return type(module).__name__
        return None

    def document_masking(self) -> str | None:
        """None when every attention sub-layer declares ``document_masking`` (it keeps a packed
        row's documents apart, ``yamlformer.blocks.attention``'s protocol); else the class name of the first
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
        sublayers = [("attention", lambda h: self.attention(h, inputs, cache=caches.get("attention")))]
        if self.cross_attention is not None:
            sublayers.append(
                (
                    "cross_attention",
                    lambda h: self.cross_attention(
                        h, memory_inputs, cache=caches.get("cross_attention"), memory=memory
                    ),
                )
            )
        sublayers.append(("ffn", self.ffn))
        if not self.parallel_residual:
            for name, fn in sublayers:
                x = self._sublayer(x, name, fn)
            return x
        h = self.attention_norm(x) if self.parallel_residual == "shared_norm" else x
        out = x
        for name, fn in sublayers:
            out = out + self._branch(h, name, fn)
        return out
