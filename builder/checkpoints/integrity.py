"""Checksums that prove a checkpoint whole, stored with it and checked when it is read.

``torch.load`` does not check the bytes of a tensor: a bit flipped on disk or in transfer loads
silently and trains or evaluates on damaged weights. So every checkpoint ``builder train`` writes
carries an ``integrity`` record (:func:`seal`): the CRC-32 of each tensor (its dtype, shape and
bytes) by its path in the checkpoint (``state_dict/model.head.weight``,
``optimizer_states/0/state/3/exp_avg``) and one CRC-32 of every other value (step, loop state,
recipe), in order; :func:`verify` recomputes it. A sharded checkpoint (a folder written by
``torch.distributed.checkpoint``) is checked by its files instead: :func:`file_digests` when it is
written (each rank its own ``__R_*.distcp`` files), :func:`verify_files` when it is read.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from yamlformer.builder.checkpoints.format import DamagedCheckpointError

#: the key of the record in a checkpoint
KEY = "integrity"
ALGORITHM = "crc32"
#: tensors at least this large are hashed on a thread pool (zlib releases the GIL)
_PARALLEL_BYTES = 1 << 22
_CHUNK = 1 << 24


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
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    header = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    if hasattr(tensor, "__tensor_flatten__"):  # a tensor subclass (an NF4 weight): its inner tensors'
        crc = zlib.crc32(header)
        for name in tensor.__tensor_flatten__()[0]:
            crc = zlib.crc32(_tensor_crc(getattr(tensor, name)).to_bytes(4, "little"), crc)
        return crc
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous().reshape(-1)
    if data.numel() and data.stride() != (1,):  # a size-1 dim keeps any stride, which view() refuses
        data = torch.empty_like(data, memory_format=torch.contiguous_format).copy_(data)  # (NF4's scale: (64,))
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
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
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


# -- sharded checkpoints: checksums of files -------------------------------------------------------


def file_crc(path: str | Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digests(folder: str | Path, names: list[str]) -> dict[str, int]:
    """CRC-32 of each of ``names`` (files in ``folder``): a rank's own shard files after it wrote
    them, gathered by the writer into the checkpoint (``yamlformer.builder.checkpoints.SHARD_FILES``)."""
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
