"""Instruction and chat data for ``task: sft``: records read from JSON Lines or Parquet, encoded by
:mod:`yamlformer.recipes.data.chat` (the loss on the answers only), packed into rows, served
resumably.

A record is ``{"prompt", "response"}`` (and ``"system"``) or ``{"messages": [...]}``, one a line of
a ``.jsonl`` (``.gz``, ``.zst``) file or a row of a ``.parquet`` one. A record that is not one, or
that renders to more than ``data.seq_len`` tokens, stops the run in one line naming its file and
line (or row), never quoting it.

Packing (``data.packing: true``): the training records, shuffled once by the seed, fill rows of
``seq_len + 1`` tokens, each record whole in the first of the last :data:`OPEN_ROWS` rows with
room for it (first fit: a short record fills an earlier row's gap, so rows end fuller than when
each record goes to the newest row: 85% against 70% for records of 48-256 tokens in rows of 257,
``tests/test_sft.py``), else a new one; a row's records are its documents
(the model masks attention across them and restarts their positions:
``yamlformer.blocks.stacks``), and a token is a target only where it is an answer's and its
predecessor is of the same record. The rest of a row is padding, a document of its own, never a
target. ``packing: false``: one record a row. Micro-batch ``j`` of step ``s`` on rank ``r`` takes
the rows of global index ``((s x accumulate + j) x ranks + r) x batch_size`` on, in an order each
pass over the rows shuffles anew by the seed: the data position is the step, so a run resumes on
any number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset

from yamlformer.recipes.data.chat import Encoded
from yamlformer.recipes.data.records import encode_file, read_records, shuffled
from yamlformer.recipes.data.windows import IGNORE, PositionedDataModule, loader

__all__ = ["IGNORE", "OPEN_ROWS", "InstructionData", "Rows", "encode_file", "pack", "read_records", "shuffled"]


#: how many of the newest rows a record may join (first fit, module doc): the packing's cost per
#: record is bounded, and a row this far back is as good as closed
OPEN_ROWS = 64


def pack(lengths: list[int], width: int, window: int = OPEN_ROWS) -> list[list[int]]:
    """The records (their indices, each row's in order) of each row of ``width`` tokens: every
    record, in turn, into the first of the last ``window`` open rows it fits in, else a new row
    (module doc). A row closes when no record could fit in what is left of it."""
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []  # oldest first
    shortest = min(lengths, default=0)
    for i, n in enumerate(lengths):
        row = next((r for r in open_rows if room[r] >= n), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room.append(width)
            open_rows.append(row)
            if len(open_rows) > window:
                open_rows.pop(0)
        rows[row].append(i)
        room[row] -= n
        if room[row] < shortest:
            open_rows.remove(row)
    return rows


class Rows:
    """Records packed into rows of ``seq_len + 1`` tokens (module doc): ``ids``, ``trained`` (a
    target of the loss) and ``documents`` (each token's record within its row), ``(rows, seq_len + 1)``;
    ``records``: the indices of each row's records."""

    def __init__(self, records: list[Encoded], seq_len: int, pad: int, packing: bool):
        width = seq_len + 1
        lengths = [len(record) for record in records]
        self.records = pack(lengths, width) if packing else [[i] for i in range(len(records))]
        rows = [[records[i] for i in row] for row in self.records]
        self.ids = np.full((len(rows), width), pad, dtype=np.int64)
        self.trained = np.zeros((len(rows), width), dtype=bool)
        self.documents = np.zeros((len(rows), width), dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for d, record in enumerate(row):
                self.ids[r, at : at + len(record)] = record.ids
                self.trained[r, at : at + len(record)] = record.trained
                self.documents[r, at : at + len(record)] = d
                at += len(record)
            self.documents[r, at:] = len(row)  # the padding: a document of its own
        self.tokens = sum(len(record) for record in records)

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(inputs, targets, document_ids)`` of rows ``index``: a target where the next token is
        an answer's and of the same record, else ``IGNORE``."""
        ids, trained, documents = (torch.from_numpy(a[index]) for a in (self.ids, self.trained, self.documents))
        keep = trained[:, 1:] & (documents[:, 1:] == documents[:, :-1])
        targets = ids[:, 1:].masked_fill(~keep, IGNORE)
        return ids[:, :-1].contiguous(), targets, documents[:, :-1].contiguous()


class TrainRows(IterableDataset):
    """Endless micro-batches of training rows from micro-batch ``position`` on (module doc)."""

    def __init__(self, rows: Rows, batch_size: int, rank: int, world: int, position: int, seed: int):
        self.rows, self.batch_size, self.rank, self.world = rows, batch_size, rank, world
        self.position, self.seed = position, seed

    def __iter__(self):
        n, micro = len(self.rows), self.position
        orders: dict[int, np.ndarray] = {}
        while True:
            first = (micro * self.world + self.rank) * self.batch_size
            index = np.arange(first, first + self.batch_size)
            passes = index // n
            for p in set(passes.tolist()) - set(orders):
                orders[p] = shuffled(n, self.seed, p + 2)  # salts 0 and 1: the held-out split, the packing
            yield self.rows.batch(np.array([orders[p][i % n] for p, i in zip(passes, index)]))
            micro += 1


class ValRows(IterableDataset):
    """The held-out rows in order, ``batch_size`` at a time, at most ``n_batches`` batches (this
    rank's share of them). Every rank yields as many batches (``len``): a sharded model's forward
    is a collective each rank must reach, and a rank with none waited for hung the others; a rank
    short of batches (fewer than the ranks) scores the first ones again."""

    def __init__(self, rows: Rows, batch_size: int, n_batches: int, rank: int, world: int):
        self.rows, self.batch_size, self.rank, self.world = rows, batch_size, rank, world
        self.n_batches = min(n_batches, -(-len(rows) // batch_size))

    def __len__(self) -> int:
        return max(1, self.n_batches // self.world)

    def __iter__(self):
        for k in range(len(self) if self.n_batches else 0):
            b = (k * self.world + self.rank) % self.n_batches
            index = np.arange(b * self.batch_size, min((b + 1) * self.batch_size, len(self.rows)))
            yield self.rows.batch(index)


class InstructionData(PositionedDataModule):
    """The packed training and validation rows; its state is the micro-batches taken."""

    def __init__(self, train: Rows, validation: Rows, batch_size: int, seed: int, val_batches: int, accumulate: int):
        super().__init__(seed, accumulate)
        self.train, self.validation = train, validation
        self.batch_size, self.val_batches = batch_size, val_batches

    def train_dataloader(self):
        rank, world = self._rank()
        position = self.trainer.global_step * self.accumulate if self.trainer is not None else self.position
        return loader(TrainRows(self.train, self.batch_size, rank, world, position, self.seed), self.trainer)

    def val_dataloader(self):
        rank, world = self._rank()
        return loader(ValRows(self.validation, self.batch_size, self.val_batches, rank, world), self.trainer)
