"""Decoding caches: what an attention module's ``new_cache`` returns, and one cache per stack.

* :class:`TensorCache` holds the tensors a :class:`~blocks.configs.base.CacheLayout` names
  (multi-head attention: ``k`` and ``v``; a latent attention: its compressed vector and rotary
  key), each ``(batch, heads, capacity, width)``, preallocated for ``capacity`` positions
  (``min(max_tokens, window)``). A windowed layer whose capacity is the window keeps a ring
  buffer that evicts the oldest positions. ``update`` returns the kept past and the new
  positions in token order with the token index of the first, so causal and window masks,
  ALiBi distances and relative buckets stay exact at any decoding offset.
* :class:`MemoryCache` holds what a cross-attention projects once from the encoder output.
* :class:`KVCache` is one mapping per layer (sub-layer name -> its cache) built by each
  layer's ``new_cache``; ``length`` counts the tokens already fed.

``nbytes()`` is exactly what the config's ``CacheLayout.nbytes`` (and so ``describe``) reports.
"""

from __future__ import annotations

import torch

from blocks.configs.base import CacheLayout


class TensorCache:
    """Self-attention's cached tensors for one layer (see the module doc)."""

    def __init__(self, layout: CacheLayout, batch: int, max_tokens: int, dtype: torch.dtype, device):
        self.capacity = layout.positions(max_tokens)
        self.window = layout.window
        self.names = tuple(t.name for t in layout.tensors)
        self.tensors = [
            torch.zeros((batch, t.heads, self.capacity, t.width), dtype=dtype, device=device)
            for t in layout.tensors
        ]  # each (batch, heads, capacity, width)
        self.length = 0  # tokens written so far

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names.index(name)]

    def update(self, *new: torch.Tensor) -> tuple:
        """Append ``new`` (one ``(batch, heads, n, width)`` tensor per layout tensor, in order);
        return ``(*cached, first)``: every tensor over the positions the new queries attend to,
        in token order, and the token index of the first of them."""
        if len(new) != len(self.tensors):
            raise ValueError(f"this cache holds {', '.join(self.names)}; got {len(new)} tensors")
        start, n, cap = self.length, new[0].shape[2], self.capacity
        if start + n <= cap:  # no eviction yet: slot == token index
            for store, x in zip(self.tensors, new):
                store[:, :, start : start + n] = x
            self.length += n
            return (*(store[:, :, : start + n] for store in self.tensors), 0)
        if self.window is None:
            raise ValueError(
                f"KV cache full: allocated for {cap} tokens, asked to hold {start + n}; "
                "allocate it for prompt + max_new_tokens"
            )
        # Ring buffer: token i lives in slot i % cap. The kept past (at most cap tokens, which
        # covers the window) is read back in token order ahead of the new positions.
        kept = min(start, cap)
        slots = torch.arange(start - kept, start, device=new[0].device) % cap
        out = [torch.cat((store.index_select(2, slots), x), dim=2) for store, x in zip(self.tensors, new)]
        stored = min(n, cap)  # (batch, heads, kept + n, width) each
        new_slots = torch.arange(start + n - stored, start + n, device=new[0].device) % cap
        for store, x in zip(self.tensors, new):
            store[:, :, new_slots] = x[:, :, n - stored :]
        self.length += n
        return (*out, start - kept)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search), in place."""
        for store in self.tensors:
            store.copy_(store.index_select(0, index))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class MemoryCache:
    """A cross-attention's projections of the encoder output, computed on the first step."""

    def __init__(self):
        self.tensors: tuple[torch.Tensor, ...] | None = None

    def reorder(self, index: torch.Tensor) -> None:
        if self.tensors is not None:
            self.tensors = tuple(t.index_select(0, index) for t in self.tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors or ())


class KVCache:
    """One ``{sub-layer name: cache}`` per layer of a stack; ``length`` counts the tokens fed."""

    def __init__(self, layers: list[dict]):
        self.layers = layers
        self.length = 0

    @classmethod
    def for_stack(cls, stack, batch: int, max_tokens: int, dtype: torch.dtype, device) -> KVCache:
        """Preallocate for ``max_tokens`` tokens; each layer's attention blocks decide the shapes."""
        return cls([layer.new_cache(batch, max_tokens, dtype, device) for layer in stack.layers])

    def reorder(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            for cache in layer.values():
                cache.reorder(index)

    def nbytes(self) -> int:
        """Bytes held by every layer's caches (self- and cross-attention)."""
        return sum(cache.nbytes() for layer in self.layers for cache in layer.values())
