"""Checkpoints that prove they are whole: a checksum of every tensor, stored with the checkpoint
and checked when it is read.

``torch.load`` does not check the bytes of a tensor: a bit flipped on disk or in transfer loads
silently and trains or evaluates on damaged weights. So every checkpoint ``builder train`` writes
carries an ``integrity`` record (:func:`seal`): the CRC-32 of each tensor (its dtype, shape and
bytes) by its path in the checkpoint (``state_dict/model.head.weight``,
``optimizer_states/0/state/3/exp_avg``) and one CRC-32 of every other value (step, loop state,
recipe), in order. :func:`read_checkpoint` loads a file safely (``weights_only``), turns the ways
a file can be broken (empty, truncated, garbage, an unsafe pickle) into one-line errors that name
it, and :func:`verify` recomputes the record.

A sharded checkpoint (a folder written by ``torch.distributed.checkpoint``) is checked by its
files instead: :func:`file_digests` when it is written (each rank its own ``__R_*.distcp`` files),
:func:`verify_files` when it is read.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: the key of the record in a checkpoint
KEY = "integrity"
ALGORITHM = "crc32"
#: tensors at least this large are hashed on a thread pool (zlib releases the GIL)
_PARALLEL_BYTES = 1 << 22
_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A path that is not a readable ``builder train`` checkpoint."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose bytes are not the ones written: empty, truncated, overwritten, or a
    tensor or value that does not match its checksum."""


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` of a checkpoint's nested mappings and sequences, in their order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if path == "" and key == KEY:
                continue
            yield from _leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{path}/{index}")
    else:
        yield path, tree


def _tensor_crc(tensor) -> int:
    """CRC-32 of a tensor's dtype, shape and values (a view hashes the values it shows)."""
    import torch

    header = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous().reshape(-1)
    if data.numel() == 0:
        return zlib.crc32(header)
    raw = memoryview(data.view(torch.uint8).numpy()) if data.dtype != torch.uint8 else memoryview(data.numpy())
    crc = zlib.crc32(header)
    for start in range(0, len(raw), _CHUNK):
        crc = zlib.crc32(raw[start : start + _CHUNK], crc)
    return crc


def _value_text(value: Any) -> bytes:
    if isinstance(value, bytes):
        return b"bytes:" + value
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__}:{value!r}".encode()
    return f"{type(value).__name__}".encode()  # an object whose repr may not be stable: its type only


def digests(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The integrity record of ``checkpoint`` (everything in it but the record itself)."""
    import torch

    tensors: list[tuple[str, Any]] = []
    rest = 0
    for path, leaf in _leaves(checkpoint):
        if isinstance(leaf, torch.Tensor):
            tensors.append((path, leaf))
        else:
            rest = zlib.crc32(path.encode() + b"=" + _value_text(leaf) + b"\n", rest)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    if total >= _PARALLEL_BYTES and len(tensors) > 1:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            crcs = list(pool.map(_tensor_crc, (t for _, t in tensors)))
    else:
        crcs = [_tensor_crc(t) for _, t in tensors]
    return {"algorithm": ALGORITHM, "tensors": dict(zip((p for p, _ in tensors), crcs)), "values": rest}


def seal(checkpoint: dict) -> dict:
    """Add the integrity record to ``checkpoint`` (in place, and returned) just before it is saved."""
    checkpoint.pop(KEY, None)
    checkpoint[KEY] = digests(checkpoint)
    return checkpoint


def is_sealed(checkpoint: Mapping[str, Any]) -> bool:
    return isinstance(checkpoint.get(KEY), Mapping)


def verify(checkpoint: Mapping[str, Any], source: str | Path) -> bool:
    """Check ``checkpoint`` (as loaded from ``source``) against its record. Returns False when it
    has none (written before checkpoints were sealed); raises :class:`DamagedCheckpointError`
    naming the file and the first tensor or value that differs."""
    record = checkpoint.get(KEY)
    if record is None:
        return False
    if not isinstance(record, Mapping) or record.get("algorithm") != ALGORITHM:
        raise DamagedCheckpointError(f"{source} is damaged: its checksum record is unreadable")
    found = digests(checkpoint)
    expected, actual = record.get("tensors", {}), found["tensors"]
    for name in expected:
        if name not in actual:
            raise DamagedCheckpointError(f"{source} is damaged: tensor {name} is missing")
        if actual[name] != expected[name]:
            bad = [n for n in expected if n in actual and actual[n] != expected[n]]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise DamagedCheckpointError(f"{source} is damaged: tensor {name}{more} does not match its checksum")
    extra = [name for name in actual if name not in expected]
    if extra:
        raise DamagedCheckpointError(f"{source} is damaged: it holds tensor {extra[0]}, which was not saved")
    if found["values"] != record.get("values"):
        raise DamagedCheckpointError(
            f"{source} is damaged: its step, loop state or metadata do not match their checksum"
        )
    return True


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "central directory" in text or "zip archive" in text or isinstance(exc, EOFError):
        return "it is cut short (truncated) or is not a checkpoint file"
    if "invalid load key" in text or isinstance(exc, pickle.UnpicklingError):
        return "its contents are not a checkpoint (overwritten or garbage)"
    return text[:200]


def not_ours(path: str | Path, checkpoint: Mapping[str, Any]) -> str:
    """The words for a loadable checkpoint that ``builder train`` did not write (no ``builder``
    record with its spec, weights and tokenizer): whose it looks like, when that can be told."""
    why = (
        "a Lightning checkpoint of another program"
        if "pytorch-lightning_version" in checkpoint
        else "it has no spec, weights or tokenizer"
    )
    return f"{path} was not written by `builder train` ({why})"


#: what a file written by ``torch.save`` is named
SUFFIXES = (".ckpt", ".pt", ".pth")


def looks_like_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is meant as a checkpoint, not a spec: its suffix, else its first bytes (the
    zip archive ``torch.save`` writes, or a pickle)."""
    path = Path(path)
    if path.suffix in SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def read_checkpoint(path: str | Path, *, check: bool = True, mmap: bool = True) -> dict:
    """A checkpoint file loaded with ``torch.load(weights_only=True)`` (memory-mapped: tensors are
    read as they are touched) and, with ``check``, verified against its record.

    Raises :class:`CheckpointError` for a missing file, a folder, or a file that holds Python
    objects a weights-only load refuses; :class:`DamagedCheckpointError` for an empty, truncated
    or garbled file or a checksum that does not match. Each is one line naming ``path``.
    """
    import torch

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise DamagedCheckpointError(f"{path} is damaged: it is empty (0 bytes)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        zipped = zipfile.is_zipfile(path)  # torch.save writes a zip archive; its directory is at the end
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not zipped and not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(EOFError())}")
    try:
        with warnings.catch_warnings():  # torch warns about a pickle protocol it did not write
            warnings.simplefilter("ignore")
            # a pickle (torch's legacy format, or pickle.dump) is read as safely as a zip archive
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipped)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc) or "global" in str(exc):  # torch names the global it refused
            raise CheckpointError(
                f"{path} is not a checkpoint this tool can load safely: it holds Python objects "
                "besides tensors and plain values"
            ) from None
        if not zipped:
            raise CheckpointError(
                f"{path} is not a checkpoint this tool can load safely: it is a Python pickle that "
                "torch.save did not write"
            ) from None
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RuntimeError as exc:
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    except (EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{path} is not a `builder train` checkpoint (it holds no mapping)")
    if check:
        try:
            verify(checkpoint, path)
        except DamagedCheckpointError:
            raise
        except Exception as exc:
            raise DamagedCheckpointError(f"{path} is damaged: {_reason(exc)}") from None
    return dict(checkpoint)


# -- sharded checkpoints: checksums of files -------------------------------------------------------


def file_crc(path: str | Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digests(folder: str | Path, names: list[str]) -> dict[str, int]:
    """CRC-32 of each of ``names`` (files in ``folder``): a rank's own shard files after it wrote
    them, gathered by the writer into the checkpoint (``builder.checkpoints.SHARD_FILES``)."""
    folder = Path(folder)
    return {name: file_crc(folder / name) for name in sorted(names)}


def verify_files(folder: str | Path, expected: Mapping[str, int], names: list[str] | None = None) -> None:
    """Check the files of a sharded checkpoint (all of ``expected``, or ``names`` of them)
    against their recorded CRC-32; raises :class:`DamagedCheckpointError` naming the first file
    that is missing or differs."""
    folder = Path(folder)
    for name in names if names is not None else sorted(expected):
        path = folder / name
        if name not in expected:
            raise DamagedCheckpointError(f"{folder} is damaged: {name} has no recorded checksum")
        if not path.is_file():
            raise DamagedCheckpointError(f"{folder} is damaged: {name} is missing")
        if file_crc(path) != expected[name]:
            raise DamagedCheckpointError(f"{folder} is damaged: {name} does not match its checksum")
