"""Variable-length examples in batches of like lengths under a token budget (fairseq's scheme).

Each epoch sorts the examples by length, ties broken at random, cuts the sorted order into
batches whose ``examples x longest example`` stays within ``max_tokens``, and shuffles the
batches. An epoch's batches are a pure function of ``(seed, epoch)``, so the stream of
micro-batches is a pure function of ``(seed, index)``: the data position is one integer (saved
in checkpoints), and a resumed run sees exactly the batches an unbroken one would. With N
devices, global micro-batch ``i`` of rank ``r`` is the stream's batch ``i * N + r``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from yamlformer.recipes.data.windows import PositionedDataModule, loader
from yamlformer.recipes.errors import RecipeError


def budget_batches(order: np.ndarray, lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut ``order`` (indices, sorted by length) into consecutive batches of at most ``max_tokens``
    padded tokens: ``len(batch) * max(lengths[batch]) <= max_tokens``."""
    batches, start, longest = [], 0, 0
    for i, index in enumerate(order):
        length = int(lengths[index])
        if length > max_tokens:
            raise RecipeError(f"an example of {length} tokens does not fit data.max_tokens {max_tokens}; raise it")
        grown = max(longest, length)
        if (i - start + 1) * grown > max_tokens:
            batches.append(order[start:i])
            start, grown = i, length
        longest = grown
    if start < len(order):
        batches.append(order[start:])
    return batches


def epoch_batches(lengths: np.ndarray, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """One epoch's batches in training order: sorted by length (random tie-break), shuffled."""
    rng = np.random.default_rng([seed, 7, epoch])
    order = np.lexsort((rng.random(len(lengths)), lengths))  # by length, then the random key
    batches = budget_batches(order, lengths, max_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def sorted_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Every example once, in length order (evaluation and decoding: least padding)."""
    return budget_batches(np.argsort(lengths, kind="stable"), lengths, max_tokens)


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Right-pad integer rows into ``(len(rows), longest)``."""
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


class StreamBatches(IterableDataset):
    """Training micro-batches from ``position`` on, epoch after epoch; this rank's share."""

    def __init__(self, examples, lengths, max_tokens, collate, seed, rank, world_size, position):
        self.examples, self.lengths, self.max_tokens, self.collate = examples, lengths, max_tokens, collate
        self.seed, self.rank, self.world_size, self.position = seed, rank, world_size, position

    def __iter__(self):
        index, epoch, first = self.position * self.world_size + self.rank, 0, 0  # first: stream index of the epoch's
        while True:
            batches = epoch_batches(self.lengths, self.max_tokens, self.seed, epoch)
            while index < first + len(batches):
                yield self.collate([self.examples[i] for i in batches[index - first]])
                index += self.world_size
            first += len(batches)
            epoch += 1


def split_to_multiple(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """``batches`` with the largest ones halved until their number divides ``world_size`` (every
    example still once, each batch within the budget): every rank then runs the same number of
    forward passes, which FSDP needs (each forward all-gathers; a rank with one batch more waits
    forever). Left as they are when there are too few examples to split into such a number."""
    batches = list(batches)
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            break
        half = len(batches[largest]) // 2
        batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
    return batches


class FixedBatches(IterableDataset):
    """Every example once in length order; rank ``r`` takes batches ``r, r + N, ...`` (as many on
    every rank: :func:`split_to_multiple`)."""

    def __init__(self, examples, lengths, max_tokens, collate, rank: int = 0, world_size: int = 1):
        batches = split_to_multiple(sorted_batches(lengths, max_tokens), world_size)
        self.batches = batches[rank::world_size]
        self.examples, self.collate = examples, collate

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            yield self.collate([self.examples[i] for i in batch])


class BucketDataModule(PositionedDataModule):
    """Token-budget batches of training and validation examples; its state is the data position.

    ``collate(list of examples) -> tuple of tensors``; ``lengths``: each example's padded cost
    in tokens (the longer side of a sentence pair)."""

    def __init__(
        self,
        train: Sequence,
        train_lengths: np.ndarray,
        val: Sequence,
        val_lengths: np.ndarray,
        collate: Callable,
        max_tokens: int,
        seed: int,
        accumulate: int,
    ):
        super().__init__(seed, accumulate)
        if not len(train) or not len(val):
            raise RecipeError(f"{len(train)} training and {len(val)} validation examples; both need some")
        self.train, self.val, self.collate = train, val, collate
        self.train_lengths, self.val_lengths = np.asarray(train_lengths), np.asarray(val_lengths)
        self.max_tokens = max_tokens

    def train_dataloader(self):
        data = StreamBatches(
            self.train, self.train_lengths, self.max_tokens, self.collate, self.seed, *self._rank(), self.position
        )
        return loader(data, self.trainer)

    def val_dataloader(self):
        data = FixedBatches(self.val, self.val_lengths, self.max_tokens, self.collate, *self._rank())
        return loader(data, self.trainer)
