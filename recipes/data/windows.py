"""The corpus: read once, tokenized once into a memory-mapped array, cut into random windows.

Training windows are a pure function of (seed, optimizer step): step ``s`` draws
``batch_size x ranks x accumulate`` window offsets from a generator seeded with ``(seed, s)``,
and micro-batch ``j`` of the step on data-parallel rank ``r`` takes slice ``j x ranks + r``. So
the data position is one integer (micro-batches consumed, saved in checkpoints), a resumed run
sees exactly the batches an unbroken one would, and one global batch is the same windows however
it is split: N devices with batch B, one device with batch N x B, or one device accumulating N
micro-batches of B (which then also see the same micro-batches as the N devices).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from recipes import datasets
from recipes.config import DataSection, RecipeError, resolve


@dataclasses.dataclass
class Corpus:
    text: str
    files: list[str]
    hash: str


def _source_files(source: str, section: DataSection, recipe_file: Path | None) -> list[Path]:
    if source in datasets.DATASETS:  # a name wins over a file of that name: write ./name for the file
        return datasets.text_files(source, section.dataset_root(recipe_file))
    path = resolve(recipe_file, source)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = {f for pattern in section.include for f in path.rglob(pattern) if f.is_file()}
        return sorted(found)
    raise RecipeError(f"data.sources: {source!r} is neither a file nor a folder (looked at {path})")


def read_corpus(section: DataSection, recipe_file: Path | None) -> Corpus:
    """The dataset's and the sources' text, in order, files joined by a newline, cut off at ``max_bytes``."""
    texts: list[str] = []
    files: list[str] = []
    size = 0
    for source in section.corpus():
        for path in _source_files(source, section, recipe_file):
            if section.max_bytes is not None and size >= section.max_bytes:
                break
            text = path.read_text(encoding="utf-8", errors="replace")
            if section.max_bytes is not None:
                text = text[: section.max_bytes - size]
            texts.append(text)
            files.append(str(path))
            size += len(text)
    text = "\n".join(texts)
    if not text.strip():
        raise RecipeError(f"data {section.corpus()} holds no text")
    return Corpus(text=text, files=files, hash=hashlib.sha256(text.encode("utf-8")).hexdigest()[:16])


def tokenize_corpus(tokenizer, corpus: Corpus, cache_dir: Path) -> np.ndarray:
    """The corpus as token ids in a read-only memory map, tokenized once per (corpus, tokenizer)."""
    from tqdm.auto import tqdm

    from recipes.tokenizer import write_atomic

    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    path = cache_dir / "tokens" / f"{corpus.hash}-{tokenizer.fingerprint()}.{np.dtype(dtype).name}.bin"
    if not path.is_file():
        parts: list[np.ndarray] = []
        # position 0: a bar another caller left open must not push this one down a line (tqdm then moves
        # the cursor up with escape codes that land in front of the next message on stderr)
        with tqdm(total=len(corpus.text), desc="tokenizing", unit="char", unit_scale=True, leave=False,
                  position=0, file=sys.stderr) as bar:
            for chars, ids in tokenizer.encode_corpus(corpus.text):
                parts.append(np.asarray(ids, dtype=dtype))
                bar.update(chars)
        write_atomic(path, np.concatenate(parts).tobytes())
    return np.memmap(path, dtype=dtype, mode="r")


def split(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``1 - val_fraction`` of the tokens for training, the rest held out."""
    cut = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:cut], tokens[cut:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 1:
            raise RecipeError(
                f"the {name} split has {len(part)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "add data, lower data.seq_len or change data.val_fraction"
            )
    return train, val


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for windows starting at ``offsets``."""
    rows = offsets[:, None] + np.arange(seq_len + 1)  # (batch, seq_len + 1)
    block = torch.from_numpy(tokens[rows].astype(np.int64))
    return block[:, :-1], block[:, 1:]


def window_offsets(seed: int, stream: int, index: int, count: int, high: int) -> np.ndarray:
    """``count`` window starts in ``[0, high)`` for micro-batch ``index``: a pure function."""
    return np.random.default_rng([seed, stream, index]).integers(0, high, size=count)


class TrainWindows(IterableDataset):
    """Endless micro-batches of random windows from ``position`` on; this rank's slice of each."""

    def __init__(self, tokens, seq_len, batch_size, seed, rank, world_size, position, accumulate=1):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank, self.world_size, self.position = seed, rank, world_size, position
        self.accumulate = accumulate

    def __iter__(self):
        index = self.position  # micro-batches consumed
        high = len(self.tokens) - self.seq_len
        per_step = self.batch_size * self.world_size * self.accumulate
        while True:
            step, micro = divmod(index, self.accumulate)
            first = (micro * self.world_size + self.rank) * self.batch_size
            offsets = window_offsets(self.seed, 0, step, per_step, high)
            yield windows(self.tokens, offsets[first : first + self.batch_size], self.seq_len)
            index += 1


class ValWindows(IterableDataset):
    """The same ``n_batches`` micro-batches of held-out windows at every validation."""

    def __init__(self, tokens, seq_len, batch_size, n_batches, seed, rank, world_size):
        self.tokens, self.seq_len, self.batch_size, self.n_batches = tokens, seq_len, batch_size, n_batches
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def __len__(self):
        return self.n_batches

    def __iter__(self):
        high = len(self.tokens) - self.seq_len
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        for index in range(self.n_batches):
            offsets = window_offsets(self.seed, 1, index, self.batch_size * self.world_size, high)
            yield windows(self.tokens, offsets[mine], self.seq_len)


class PositionedDataModule(L.LightningDataModule):
    """A data module whose whole state is its position: the micro-batches consumed, restored
    from checkpoints (``accumulate`` micro-batches per optimizer step)."""

    def __init__(self, seed: int, accumulate: int):
        super().__init__()
        self.seed, self.accumulate = seed, accumulate
        self.position = 0

    def _rank(self) -> tuple[int, int]:
        """``(rank, ranks)`` among the ranks that read different data (tensor-parallel peers
        read the same)."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", trainer.global_rank)), int(kwargs.get("num_replicas", trainer.world_size))

    def state_dict(self) -> dict:
        if self.trainer is not None:
            self.position = self.trainer.global_step * self.accumulate
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class LMDataModule(PositionedDataModule):
    """Training and validation windows over a tokenized corpus; its state is the data position."""

    def __init__(self, tokens: np.ndarray, section: DataSection, seed: int, val_batches: int, accumulate: int):
        super().__init__(seed, accumulate)
        self.section, self.val_batches = section, val_batches
        self.train_tokens, self.val_tokens = split(tokens, section.val_fraction, section.seq_len)

    def train_dataloader(self):
        rank, world = self._rank()
        data = TrainWindows(
            self.train_tokens, self.section.seq_len, self.section.batch_size, self.seed, rank, world, self.position,
            self.accumulate,
        )
        return DataLoader(data, batch_size=None, num_workers=0)

    def val_dataloader(self):
        rank, world = self._rank()
        data = ValWindows(
            self.val_tokens, self.section.seq_len, self.section.batch_size, self.val_batches, self.seed, rank, world
        )
        return DataLoader(data, batch_size=None, num_workers=0)
