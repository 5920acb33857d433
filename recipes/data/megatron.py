"""Token files other tools wrote, read in place (memory-mapped, no conversion): Megatron-LM's
indexed datasets and nanoGPT's raw token files.

Megatron-LM's ``.idx`` (``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter``), all
little-endian: the 9-byte header ``MMIDIDX\\x00\\x00``, version ``<Q`` (1), the dtype code ``<B``
(1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count
``<Q``, the document count ``<Q``, then ``int32[sequences]`` sequence lengths, ``int64[sequences]``
byte offsets of each sequence in the ``.bin``, and ``int64[documents]`` document boundaries as
sequence indices (``0 ... sequences``; one more than the documents). ``tools/preprocess_data.py``
writes one sequence per document (several with ``--split-sentences``) and appends EOD only with
``--append-eod``. A raw ``.bin`` is a flat array of token ids (nanoGPT's ``prepare.py``: uint16).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from yamlformer.recipes.errors import RecipeError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
#: dtype codes that hold token ids
TOKEN_CODES = (1, 3, 4, 5, 8)


class Part:
    """One array of token ids with its document ends (``ends[i]``: one past document i's last
    token; ``None``: one document, a raw token file), read-only and memory-mapped; ``start`` and
    ``stop`` take a range of it (a split's tail). A part pickles as its file's name, not its
    tokens, so a data-loader worker started by ``spawn`` maps the file again instead of copying it."""

    def __init__(
        self, tokens: np.ndarray, ends: np.ndarray | None, path: Path | None, start: int = 0, stop: int | None = None
    ):
        self._array, self.ends, self.path = tokens, ends, path
        self.start, self.stop = start, len(tokens) if stop is None else stop

    @property
    def tokens(self) -> np.ndarray:
        return self._array[self.start : self.stop]

    @property
    def n_documents(self) -> int:
        return 1 if self.ends is None else len(self.ends)

    def take(self, start: int, stop: int, ends: np.ndarray | None) -> Part:
        """Tokens ``start .. stop`` of this part, with their document ends."""
        return Part(self._array, ends, self.path, self.start + start, self.start + stop)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": _mapped(self._array), "ends": _mapped(self.ends)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _array=_unmapped(state["_array"]), ends=_unmapped(state["ends"]))


def _mapped(array):
    """A whole-file memory map as ``(file, dtype, offset, shape)``; any other array as it is."""
    if isinstance(array, np.memmap) and array.filename is not None and isinstance(array.base, mmap.mmap):
        return ("memmap", array.filename, array.dtype.str, array.offset, array.shape)
    return array


def _unmapped(value):
    if isinstance(value, tuple) and value and value[0] == "memmap":
        _, filename, dtype, offset, shape = value
        return np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
    return value


def megatron_prefix(path: Path) -> Path | None:
    """The dataset prefix when ``path`` is a Megatron dataset's prefix, ``.bin`` or ``.idx`` and both
    files are there; else None."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_suffix(".idx").is_file() and prefix.with_suffix(".bin").is_file():
        return prefix
    return None


def read_megatron(prefix: Path) -> Part:
    """A Megatron-LM indexed dataset (``prefix.bin`` / ``prefix.idx``) as one :class:`Part`;
    a file that is not Megatron's, or a ``.bin`` shorter than its index says, is refused naming it."""
    idx, bin_path = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    try:
        index = np.memmap(idx, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{idx}: cannot be read ({exc.__class__.__name__})") from None
    fixed = len(HEADER) + 8 + 1 + 8 + 8
    if bytes(index[: len(HEADER)]) != HEADER:
        raise RecipeError(f"{idx}: not a Megatron-LM index (no MMIDIDX header)")
    if len(index) < fixed:
        raise RecipeError(f"{idx}: truncated ({len(index):,} bytes, shorter than its header)")
    version, code, n_seq, n_docs = struct.unpack_from("<QBQQ", bytes(index[len(HEADER) : fixed]))
    if version != VERSION:
        raise RecipeError(f"{idx}: Megatron index version {version}; this reader knows version {VERSION}")
    if code not in TOKEN_CODES:
        raise RecipeError(f"{idx}: dtype code {code} is not an integer token type (codes {TOKEN_CODES})")
    need = fixed + 4 * n_seq + 8 * n_seq + 8 * n_docs
    if len(index) < need or n_docs < 1:
        raise RecipeError(f"{idx}: truncated ({len(index):,} bytes; its header needs {need:,})")
    lengths = np.frombuffer(index, dtype="<i4", count=n_seq, offset=fixed)
    pointers = np.frombuffer(index, dtype="<i8", count=n_seq, offset=fixed + 4 * n_seq)
    doc_index = np.frombuffer(index, dtype="<i8", count=n_docs, offset=fixed + 12 * n_seq)
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    tokens_total = int(lengths.sum(dtype=np.int64))
    if n_seq and (
        pointers[0] != 0 or np.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * dtype.itemsize)
    ):
        raise RecipeError(
            f"{idx}: its sequences are not laid out back to back in {bin_path.name}; "
            "this reader reads contiguous Megatron datasets only"
        )
    if doc_index[0] != 0 or doc_index[-1] != n_seq or np.any(np.diff(doc_index) < 0):
        raise RecipeError(f"{idx}: its document index does not run from 0 to the {n_seq:,} sequences")
    size = bin_path.stat().st_size
    if size != tokens_total * dtype.itemsize:
        raise RecipeError(
            f"{bin_path}: {size:,} bytes, its index says {tokens_total * dtype.itemsize:,} "
            f"(truncated or another dataset's)"
        )
    if tokens_total == 0:
        raise RecipeError(f"{bin_path}: holds no tokens")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    seq_ends = np.cumsum(lengths, dtype=np.int64)
    ends = seq_ends[doc_index[1:] - 1] if n_seq else np.zeros(0, np.int64)
    ends = ends[np.concatenate([[True], np.diff(ends) > 0])] if len(ends) else ends  # empty documents dropped
    return Part(tokens, ends, bin_path)


def write_megatron(prefix: Path, documents: list[np.ndarray], dtype=np.uint16) -> None:
    """Write ``documents`` (arrays of ids) as a Megatron-LM indexed dataset, one sequence per
    document, by the layout above (tests and conversions; Megatron's own writer is the reference)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    code = next(c for c, t in DTYPES.items() if np.dtype(t) == dtype.newbyteorder("="))
    lengths = np.array([len(d) for d in documents], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype("<i8") * dtype.itemsize
    with open(prefix.with_suffix(".bin"), "wb") as f:
        for doc in documents:
            f.write(np.asarray(doc, dtype=dtype).tobytes())
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(HEADER + struct.pack("<QBQQ", VERSION, code, len(documents), len(documents) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(documents) + 1, dtype="<i8").tobytes())


def read_raw(path: Path, dtype: str) -> Part:
    """A raw token file (nanoGPT's ``train.bin``): the whole file as ids of ``dtype``."""
    dtype = np.dtype(dtype).newbyteorder("<")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise RecipeError(
            f"{path}: {size:,} bytes is not a whole number of {dtype.name} tokens "
            f"(set the source's dtype to the type it was written with)"
        )
    return Part(np.memmap(path, dtype=dtype, mode="r"), None, path)
