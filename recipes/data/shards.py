"""The worker side of ``builder tokenize`` (:mod:`yamlformer.recipes.data.tokenize`): a *unit* of documents
encoded and written as the shard files of each split it has documents of (a temp file, fsync,
rename), handing back only their sizes and checksums. Workers are processes that build the
tokenizer once from its ``state()`` and encode on one thread. Torch-free."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.errors import RecipeError

#: text handed to one encode_batch call: enough to amortize the call, small enough that the
#: library's per-token objects (tokenizers keeps strings and offsets per token) stay a few MB
BATCH_CHARS = 1 << 20
#: a longer document is encoded in pieces cut at a line break between two non-space characters
#: (no tokenizer shipped here joins across one), so no single call holds a huge document's tokens
LONG_DOCUMENT_CHARS = 8 << 20
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclasses.dataclass
class Unit:
    """A run of documents: their UTF-8 text end to end, each one's end offset and split."""

    index: int
    blob: bytes
    ends: np.ndarray  # int64 byte end offsets
    validation: np.ndarray  # bool per document
    hash: str

    @property
    def n_documents(self) -> int:
        return len(self.ends)


def shard_names(split: str, index: int) -> tuple[str, str]:
    return f"{split}/{index:05d}.bin", f"{split}/{index:05d}.idx"


# -- the worker side -----------------------------------------------------------------------------


def encode(tokenizer, texts: list[str], dtype: np.dtype, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``texts`` as one array of ids (each followed by ``eos``) and each one's end offset."""
    parts: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []
    size = 0

    def flush() -> None:
        ids = _encode_batch(tokenizer, batch)
        if eos is not None:
            for one in ids:
                one.append(eos)
        counts = [len(one) for one in ids]
        lengths.extend(counts)
        try:
            parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(counts)))
        except (OverflowError, ValueError):
            top = max(max(one, default=0) for one in ids)
            raise RecipeError(
                f"token id {top} does not fit the dataset's {dtype.name} (the tokenizer's vocabulary "
                f"says {tokenizer.vocab_size:,} ids)"
            ) from None
        batch.clear()

    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            flush()
            size = 0
    if batch:
        flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return tokens, np.cumsum(np.asarray(lengths, dtype=np.int64), dtype=np.int64)


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if all(len(t) <= LONG_DOCUMENT_CHARS for t in texts):
        return tokenizer.encode_batch(texts)
    out = []
    for text in texts:
        if len(text) <= LONG_DOCUMENT_CHARS:
            out.extend(tokenizer.encode_batch([text]))
            continue
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(tokenizer.encode_batch([piece])[0])
        out.append(ids)
    return out


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of about LONG_DOCUMENT_CHARS, cut after a newline between non-space characters."""
    start = 0
    while len(text) - start > LONG_DOCUMENT_CHARS:
        match = _CUT.search(text, start + LONG_DOCUMENT_CHARS)
        if match is None:
            break
        yield text[start : match.start()]
        start = match.start()
    yield text[start:]


def write_file(path: Path, array: np.ndarray) -> str:
    """``array``'s bytes to ``path`` (:func:`yamlformer.recipes.data.files.write_atomic`: temp file, fsync,
    rename); their sha256."""
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def tokenize_unit(unit: Unit, tokenizer, out: Path, dtype: np.dtype, eos: int | None) -> dict:
    """Unit ``unit`` tokenized into its shards under ``out``; each split's shard record."""
    ends_at = unit.ends.tolist()
    starts = [0, *ends_at[:-1]]
    shards = {}
    for split, mask in (("train", ~unit.validation), ("validation", unit.validation)):
        chosen = np.flatnonzero(mask)
        if not len(chosen):
            continue
        blob = unit.blob
        texts = [blob[starts[i] : ends_at[i]].decode("utf-8") for i in chosen.tolist()]
        tokens, ends = encode(tokenizer, texts, dtype, eos)
        del texts
        bin_name, idx_name = shard_names(split, unit.index)
        (out / split).mkdir(exist_ok=True)
        shards[split] = {
            "tokens": bin_name,
            "index": idx_name,
            "n_tokens": len(tokens),
            "n_documents": len(ends),
            "sha256": write_file(out / bin_name, tokens),
            "index_sha256": write_file(out / idx_name, ends.astype("<i8")),
        }
    for split in shards:
        fsync_folder(out / split)
    return shards


_WORKER: dict = {}


def start_worker(state: dict, out: str, dtype: str, eos: int | None) -> None:
    """A worker's start: one thread for its tokenizer (W workers use W cores), built once. Ctrl+C
    is the main process's to handle (it lets the units in flight finish and stops)."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # local: the tokenizer libraries load in the worker after its one-thread settings above
    from yamlformer.recipes.data.tokenizers import from_state

    _WORKER.update(tokenizer=from_state(state), out=Path(out), dtype=np.dtype(dtype), eos=eos)


def work(unit: Unit) -> dict:
    w = _WORKER
    return tokenize_unit(unit, w["tokenizer"], w["out"], w["dtype"], w["eos"])


def fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def one_thread():
    """This process's encode_batch calls on one thread while the block runs."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
