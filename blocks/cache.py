"""Decoding caches: what an attention module's ``new_cache`` returns, and one cache per stack.

* :class:`TensorCache` holds the tensors a :class:`~yamlformer.blocks.configs.base.CacheLayout` names
  (multi-head attention: ``k`` and ``v``; a latent attention: its compressed vector and rotary
  key), each ``(batch, heads, capacity, width)``, preallocated for ``capacity`` positions
  (``min(max_tokens, window)``). A windowed layer whose capacity is the window keeps a ring
  buffer that evicts the oldest positions (token ``i`` in slot ``i % capacity``). Two writes:

  - ``update(*new)`` (any number of new tokens; the prefill) returns the kept past and the new
    positions in token order with the token index of the first, so causal and window masks,
    ALiBi distances and relative buckets stay exact at any decoding offset.
  - ``update(*new, index=t)`` (one token whose index ``t`` is a ``(1,)`` long tensor: the static
    decoding step) writes slot ``t % capacity`` with ``index_copy_`` and returns every buffer
    whole with :func:`slot_tokens` (which token each slot holds, -1 for an empty one). No shape
    depends on ``t``, so one compiled step (``torch.compile``, static shapes) serves every
    position; the attention masks by those token indices (``yamlformer.kernels.attention``'s
    ``token_index``). The caller then calls ``advance(1)`` (outside the compiled step).
* :class:`MemoryCache` holds what a cross-attention projects once from the encoder output.
* :class:`KVCache` is one mapping per layer (sub-layer name -> its cache) built by each
  layer's ``new_cache``; ``length`` counts the tokens already fed.

``nbytes()`` is exactly what the config's ``CacheLayout.nbytes`` (and so ``describe``) reports.
"""

from __future__ import annotations

import torch

from yamlformer.blocks.configs.base import CacheLayout


def slot_tokens(index: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(capacity,)`` long: the token each slot of a buffer holds once token ``index`` ``(1,)``
    is written (slot ``s`` holds the latest token ``<= index`` with ``token % capacity == s``), or
    a negative number for a slot not written yet."""
    slots = torch.arange(capacity, device=index.device)
    return index - torch.remainder(index - slots, capacity)  # (capacity,)


class TensorCache:
    """Self-attention's cached tensors for one layer (see the module doc)."""

    def __init__(self, layout: CacheLayout, batch: int, max_tokens: int, dtype: torch.dtype, device):
        self.capacity = layout.positions(max_tokens)
        self.window = layout.window
        self.names = tuple(t.name for t in layout.tensors)
        self.tensors = [
            torch.zeros((batch, t.heads, self.capacity, t.width), dtype=dtype, device=device) for t in layout.tensors
        ]  # each (batch, heads, capacity, width)
        self.length = 0  # tokens written so far

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names.index(name)]

    def update(self, *new: torch.Tensor, index: torch.Tensor | None = None) -> tuple:
        """Append ``new`` (one ``(batch, heads, n, width)`` tensor per layout tensor, in order);
        return ``(*cached, first)``: every tensor over the positions the new queries attend to,
        in token order, and the token index of the first of them. With ``index`` (the static
        step, see the module doc): ``(*buffers, slot_tokens)``."""
        if len(new) != len(self.tensors):
            raise ValueError(f"this cache holds {', '.join(self.names)}; got {len(new)} tensors")
        if index is not None:
            slot = torch.remainder(index, self.capacity)  # (1,)
            for store, x in zip(self.tensors, new):
                store.index_copy_(2, slot, x)  # x: (batch, heads, 1, width)
            return (*self.tensors, slot_tokens(index, self.capacity))
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

    def advance(self, n: int) -> None:
        """Count ``n`` tokens written by static steps (``update(..., index=...)``)."""
        self.length += n
        if self.window is None and self.length > self.capacity:
            raise ValueError(
                f"KV cache full: allocated for {self.capacity} tokens, asked to hold {self.length}; "
                "allocate it for prompt + max_new_tokens"
            )

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

    def advance(self, n: int) -> None:
        """Nothing to count: the encoder output does not grow."""

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

    def advance(self, n: int) -> None:
        """Count ``n`` tokens fed by static decoding steps (which leave every Python count alone,
        so that one compiled step serves every position)."""
        self.length += n
        for layer in self.layers:
            for cache in layer.values():
                cache.advance(n)

    def reorder(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            for cache in layer.values():
                cache.reorder(index)

    def nbytes(self) -> int:
        """Bytes held by every layer's caches (self- and cross-attention)."""
        return sum(cache.nbytes() for layer in self.layers for cache in layer.values())
