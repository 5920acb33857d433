"""Training windows as a pure function of their global index: each source cut into windows, each
source's windows visited once per epoch in a seeded order, sources interleaved by weight.

Window ``g`` of a run (counting every window every data-parallel rank has taken) falls in a
block of :data:`BLOCK` windows; a block holds each source's share of windows (whole numbers that
follow the weights cumulatively), spread evenly through the block from a seeded phase, so every
prefix of the run, a global batch included, follows the weights to within a window or two per
source. A source's ``j``-th window is window ``perm_e[j mod n]``
of epoch ``e = j // n`` (``n`` its windows, ``perm_e`` a seeded permutation computed index by
index, so no order array grows with the corpus). So the data
position is one integer, and a run resumed at window ``g`` on any number of ranks takes exactly
the windows an unbroken run takes next: none twice within an epoch, none skipped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from yamlformer.recipes.data.megatron import Part

#: windows per interleaving block
BLOCK = 1024
#: what a corpus is refused with when no source holds out a whole window (``yamlformer.recipes.data.corpus``)
NO_VALIDATION = (
    "data: no source has a validation split with a whole window; add data, lower data.seq_len or raise "
    "data.val_fraction"
)
#: the seed streams of training and validation windows
TRAIN, VALIDATION = 0, 1


@dataclasses.dataclass
class Stream:
    """A source's split: its parts cut into consecutive windows of ``seq_len + 1`` tokens (inputs
    and their next-token targets; neighbours share one token), inside each part. With ``shift``
    (training) every epoch cuts them at another offset in ``[0, seq_len)``, so the windows of one
    epoch cover the tokens once and successive epochs see other contexts (as nanoGPT's random
    offsets do); a part too short to shift, and validation, start at 0."""

    parts: list[Part]
    seq_len: int
    shift: bool = False

    def __post_init__(self):
        def windows(n: int) -> tuple[int, bool]:
            if self.shift and (n - self.seq_len) // self.seq_len >= 1:
                return (n - self.seq_len) // self.seq_len, True  # room for any offset below seq_len
            return max(0, (n - 1) // self.seq_len), False

        counts, self.shiftable = zip(*(windows(len(p.tokens)) for p in self.parts)) if self.parts else ((), ())
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def n_windows(self) -> int:
        return int(self.starts[-1])

    @property
    def n_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.parts)

    def window(self, k: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """Window ``k``'s ``seq_len + 1`` ids (int64) and each id's document, numbered from the
        window's first (None for a part without document ends); ``offset``: this epoch's cut."""
        part_index = int(np.searchsorted(self.starts, k, side="right")) - 1
        part = self.parts[part_index]
        start = (k - int(self.starts[part_index])) * self.seq_len + (offset if self.shiftable[part_index] else 0)
        ids = np.asarray(part.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if part.ends is None:
            return ids, None
        documents = np.searchsorted(part.ends, np.arange(start, start + self.seq_len + 1), side="right")
        return ids, documents - documents[0]


@dataclasses.dataclass
class Source:
    """One source of the mixture: its training and validation streams, weight and epoch limit."""

    name: str
    train: Stream
    validation: Stream | None
    weight: float | None = None
    max_epochs: float | None = None


def shares(sources: list[Source]) -> np.ndarray:
    """Each source's share of the windows: its weight, or (no weights) its training windows."""
    raw = np.array([s.weight if s.weight is not None else s.train.n_windows for s in sources], dtype=np.float64)
    return raw / raw.sum()


class Blend:
    """Which source, and which of its windows, each global window index takes (see the module)."""

    def __init__(self, weights: np.ndarray, seed: int, stream: int):
        self.p = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.seed, self.stream = seed, stream
        self._cumulative = [np.zeros(len(self.p), dtype=np.int64)]  # windows per source before block b

    def _counts_before(self, block: int) -> np.ndarray:
        while len(self._cumulative) <= block + 1:
            b = len(self._cumulative) - 1
            before = self._cumulative[-1]
            due = (b + 1) * BLOCK * self.p - before  # what each source is owed by the end of block b
            n = np.maximum(np.floor(due), 0).astype(np.int64)
            short = BLOCK - int(n.sum())
            order = np.argsort(-(due - n), kind="stable")  # largest remainders first
            if short > 0:
                n[order[:short]] += 1
            elif short < 0:
                for i in order[::-1]:
                    take = min(int(n[i]), -short)
                    n[i] -= take
                    short += take
                    if short == 0:
                        break
            self._cumulative.append(before + n)
        return self._cumulative[block]

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        before, after = self._counts_before(block), self._counts_before(block + 1)
        counts = after - before
        # each source's windows spread evenly over the block (from a seeded phase): every prefix keeps the shares
        phase = np.random.default_rng([self.seed, self.stream, 7, block]).random(len(self.p))
        keys = np.concatenate([(np.arange(n) + phase[i]) / n for i, n in enumerate(counts.tolist()) if n])
        labels = np.repeat(np.arange(len(self.p)), counts)[np.argsort(keys, kind="stable")]
        within = np.empty(BLOCK, dtype=np.int64)
        for i in range(len(self.p)):
            where = np.flatnonzero(labels == i)
            within[where] = before[i] + np.arange(len(where))
        return labels, within

    def locate(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source index, that source's window count so far)`` for windows ``first .. first + count``."""
        if len(self.p) == 1:
            return np.zeros(count, dtype=np.int64), np.arange(first, first + count, dtype=np.int64)
        labels, within = [], []
        g = first
        while g < first + count:
            block, offset = divmod(g, BLOCK)
            take = min(BLOCK - offset, first + count - g)
            block_labels, block_within = self._block(block)
            labels.append(block_labels[offset : offset + take])
            within.append(block_within[offset : offset + take])
            g += take
        return np.concatenate(labels), np.concatenate(within)


_M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class Permutation:
    """A seeded permutation of ``range(n)`` computed one index at a time, in constant memory
    (a 4-round Feistel network over the smallest even power of two >= n, walked back into range),
    so a corpus of billions of windows needs no order array."""

    def __init__(self, n: int, keys: list[int]):
        self.n, self.keys = n, keys
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.n:
            raise IndexError(k)
        x = k
        while True:  # cycle-walking: at most a few steps, the domain is under 4n
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


def epoch_order(seed: int, stream: int, source: int, epoch: int, n: int, seq_len: int) -> tuple[int, Permutation]:
    """A source's cut offset and the order of its ``n`` windows in one epoch."""
    rng = np.random.default_rng([seed, stream, source, epoch])
    offset = int(rng.integers(seq_len))
    return offset, Permutation(n, [int(k) for k in rng.integers(0, 2**63, size=4)])


class Windows:
    """The windows of a mixture's training (or validation) streams, by global index."""

    def __init__(self, streams: list[Stream], weights: np.ndarray, seed: int, stream: int):
        self.streams, self.seed, self.stream = streams, seed, stream
        self.blend = Blend(weights, seed, stream)
        self._orders: dict[int, tuple] = {}  # source -> (epoch, offset, order): one epoch each

    def _order(self, source: int, epoch: int) -> tuple[int, Permutation]:
        held = self._orders.get(source)
        if held is None or held[0] != epoch:
            s = self.streams[source]
            held = (epoch, *epoch_order(self.seed, self.stream, source, epoch, s.n_windows, s.seq_len))
            self._orders[source] = held
        return held[1], held[2]

    def take(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Windows ``first .. first + count``: ids ``(count, seq_len + 1)``, documents (same shape, or
        None when no part has document ends) and each window's source index."""
        labels, within = self.blend.locate(first, count)
        rows, documents = [], []
        for source, j in zip(labels.tolist(), within.tolist()):
            s = self.streams[source]
            epoch, k = divmod(j, s.n_windows)
            offset, order = self._order(source, epoch)
            ids, docs = s.window(int(order[k]), offset)
            rows.append(ids)
            documents.append(docs)
        has_documents = any(d is not None for d in documents)
        docs = (
            np.stack([d if d is not None else np.zeros_like(r) for d, r in zip(documents, rows)])
            if has_documents
            else None
        )
        return np.stack(rows), docs, labels


def epochs_seen(sources: list[Source], total_windows: int, p: np.ndarray | None = None) -> list[float]:
    """How many passes over each source's training windows a run of ``total_windows`` makes
    (``p``: their shares, when not :func:`shares` of these sources)."""
    p = shares(sources) if p is None else p
    return [float(total_windows * share / s.train.n_windows) for share, s in zip(p, sources)]
