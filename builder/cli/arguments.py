"""Argument types and checks every command shares, so a bad option is refused the same way
everywhere: one line naming the option and what it takes, before any heavy work.

Sizes and counts with units (``80GiB``, ``300B``, ``16Mi``): :func:`parse_size`, :func:`parse_count`.

Types for ``parser.add_argument(type=...)`` (argparse prefixes the option's name and exits with
status 2, a usage error)::

    parser.add_argument("--seq-len", type=count(maximum=MAX_SEQ_LEN))     # 1 .. 2**30
    parser.add_argument("--top-p", type=number(above=0, maximum=1))        # (0, 1]
    parser.add_argument("--device", type=device)                           # cpu, cuda[:N], mps

A check that needs what the command loaded (a checkpoint's ``max_seq_len``) raises
:class:`ArgumentError` from :func:`at_most`; the command prints it and exits with status 1.

Exit statuses of every command: 0 done, 1 a bad input file or a refused value (the message says
which), 2 a malformed command line (argparse's usage error), 70 an internal error (a bug; see
``yamlformer.builder.cli``), 128 + n stopped by signal n.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from yamlformer.blocks.limits import MAX_SEQ_LEN
from yamlformer.builder.outputs import shown

#: sequences in one batch, on one device or in all (far above any run)
MAX_BATCH = 1 << 24
#: devices, nodes, tensor-parallel degrees (the largest clusters: ~10^5 GPUs)
MAX_DEVICES = 1 << 24
#: beams of a beam search
MAX_BEAMS = 1024
#: tokens one command may generate
MAX_NEW_TOKENS = MAX_SEQ_LEN
#: a random seed (torch takes 64-bit seeds)
MAX_SEED = 2**64 - 1


class ArgumentError(ValueError):
    """An option whose value the command refuses after loading what it needs to judge it."""


def _grouped(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def count(minimum: int = 1, maximum: int | None = None):
    """An integer from ``minimum`` to ``maximum`` (both included)."""

    def parse(text: str) -> int:
        allowed = f"an integer from {_grouped(minimum)}" + (
            f" to {_grouped(maximum)}" if maximum is not None else " up"
        )
        try:
            value = int(text.strip(), 10)
        except ValueError:  # a float, a word, or more digits than Python converts
            raise argparse.ArgumentTypeError(f"takes {allowed}, got {_cut(text)}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"takes {allowed}, got {_cut(text)}")
        return value

    parse.__name__ = "integer"  # argparse's own messages name the type
    return parse


def number(
    minimum: float | None = None, maximum: float | None = None, above: float | None = None, below: float | None = None
):
    """A finite number within the given bounds (``minimum``/``maximum`` included, ``above``/
    ``below`` excluded)."""
    low = f"[{_grouped(minimum)}" if minimum is not None else f"({_grouped(above)}" if above is not None else "(-inf"
    high = f"{_grouped(maximum)}]" if maximum is not None else f"{_grouped(below)})" if below is not None else "inf)"
    allowed = f"a finite number in {low}, {high}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {allowed}, got {_cut(text)}") from None
        if (
            not math.isfinite(value)
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (above is not None and value <= above)
            or (below is not None and value >= below)
        ):
            raise argparse.ArgumentTypeError(f"takes {allowed}, got {_cut(text)}")
        return value

    parse.__name__ = "number"
    return parse


_DEVICE = re.compile(r"(cpu|cuda|mps)(?::(\d{1,4}))?")


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, and present on this machine."""
    match = _DEVICE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"takes cpu, cuda, cuda:N or mps, got {_cut(text)}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise argparse.ArgumentTypeError(f"takes cpu, cuda, cuda:N or mps, got {_cut(text)}")
        return kind
    # local: the torch-free commands (validate, describe, plan) share these argument types
    import torch

    if kind == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise argparse.ArgumentTypeError("mps: no Apple GPU (MPS) here; use --device cpu")
        return kind
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text.strip()}: CUDA is not available here (no GPU, or a torch built without CUDA); use --device cpu"
        )
    n = torch.cuda.device_count()
    if index is not None and int(index) >= n:
        listed = ", ".join(f"cuda:{i}" for i in range(n))
        raise argparse.ArgumentTypeError(f"{text.strip()}: this machine has {n} CUDA device{'s' * (n != 1)} ({listed})")
    return text.strip()


def input_file(text: str) -> str:
    """A path to an existing regular file (not a folder, FIFO or device)."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("takes a file, got an empty path")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown(text)}: is a folder; give a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{shown(text)}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{shown(text)}: not a regular file")
    return text


def input_path(text: str) -> str:
    """A path to an existing file or folder."""
    if not text:
        raise argparse.ArgumentTypeError("takes a file or folder, got an empty path")
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{shown(text)}: no such file or folder")
    return text


def output_file(text: str) -> str:
    """A file to write: not a folder, in a folder that exists and is writable."""
    if not text:
        raise argparse.ArgumentTypeError("takes a file to write, got an empty path")
    path = Path(text)
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown(text)}: is a folder; give a file to write")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{shown(text)}: the folder {shown(parent)} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{shown(text)}: the folder {shown(parent)} is not writable")
    return text


def output_folder(text: str) -> str:
    """A folder to write into: an existing writable folder, or one that can be made (the nearest
    existing folder above it is writable)."""
    if not text:
        raise argparse.ArgumentTypeError("takes a folder to write, got an empty path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown(text)}: is a file, not a folder")
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise argparse.ArgumentTypeError(f"{shown(text)}: {shown(existing)} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{shown(text)}: {shown(existing)} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{shown(text)}: the folder {shown(existing)} is not writable")
    return text


def text(maximum: int = 1 << 20, minimum: int = 0):
    """A string of ``minimum`` to ``maximum`` characters (a prompt, a name); with ``minimum``, one
    of only spaces is empty too."""

    def parse(value: str) -> str:
        if minimum and len(value.strip()) < minimum:
            raise argparse.ArgumentTypeError(
                f"takes at least {minimum:,} character{'s' * (minimum != 1)}, got {_cut(value)}"
            )
        if len(value) > maximum:
            raise argparse.ArgumentTypeError(f"takes at most {maximum:,} characters, got {len(value):,}")
        return value

    parse.__name__ = "text"
    return parse


def at_most(option: str, value: int | None, limit: int, what: str) -> None:
    """Refuse ``option``'s ``value`` above ``limit`` (``what`` says whose limit it is)."""
    if value is not None and value > limit:
        raise ArgumentError(f"{option} {value}: more than {what} ({limit}); give at most {limit}")


def _cut(text: str, limit: int = 40) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


#: unit suffixes of sizes (decimal and binary) and counts, case-insensitive
UNITS = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str, option: str) -> int:
    """``"80GiB"`` -> 85899345920; ``"141GB"``, ``"80 gib"`` and ``"1.5TiB"`` too."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]+)\s*", text)
    unit = match and UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"{option} {text!r}: not a size such as 80GiB or 141GB")
    value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise ValueError(f"{option} {text!r}: must be more than 0")
    return value


def parse_count(text: str, option: str) -> int:
    """``"300B"`` -> 300_000_000_000; ``2T``, ``1.5e9``, ``500M``, ``4096`` too; ``16Mi`` is 2**24."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kKmMbBtT]?)(i?)\s*", text)
    if not match or (match.group(3) and match.group(2).lower() not in ("k", "m", "t")):
        raise ValueError(f"{option} {text!r}: not a count such as 300B, 2T, 1e9 or 16Mi")
    unit = match.group(2).lower()
    scale = (
        {"k": 2**10, "m": 2**20, "t": 2**40}[unit]
        if match.group(3)
        else {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[unit]
    )
    value = int(float(match.group(1)) * scale)
    if not 0 < value <= 10**16:
        raise ValueError(f"{option} {text!r}: must be from 1 to 10,000T")
    return value
