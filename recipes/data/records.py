"""Instruction and chat records read and encoded, torch-free (``task: sft``; the dry run and
``builder validate`` read them too): :func:`read_records` from JSON Lines or Parquet, each with
the ``file:line`` (or ``file: row N``) an error about it names, never quoting it;
:func:`encode_file` renders them with :mod:`yamlformer.recipes.data.chat` and refuses a record
longer than ``data.seq_len`` tokens. Packing them into rows is
:mod:`yamlformer.recipes.data.instructions`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from yamlformer.recipes.data.chat import ChatError, ChatFormat, Encoded, conversation
from yamlformer.recipes.data.sources import SourceFile, _arrow_reason, _json_kind, _open, file_format
from yamlformer.recipes.errors import RecipeError


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each record of a JSON Lines or Parquet file: ``where`` is
    ``file:line`` (``file: row N`` for Parquet), what an error about the record names."""
    kind, compression = file_format(path)
    name = str(path)
    if kind == "parquet":
        yield from _parquet(path)
        return
    if kind != "jsonl":
        raise RecipeError(f"{name}: not JSON Lines (.jsonl) or Parquet (.parquet), the formats of instruction data")
    with _open(SourceFile(path, name, "jsonl", compression, path.stat().st_size)) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{name}:{number}", json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise RecipeError(f"{name}:{number}: not UTF-8 (byte {exc.start:,} of the line)") from None
            except json.JSONDecodeError as exc:
                raise RecipeError(f"{name}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise RecipeError(
                    f"{name}:{number}: not a record: JSON nested deeper than the reader follows"
                ) from None
            except ValueError as exc:  # a number of more digits than Python converts (4,300)
                raise RecipeError(
                    f"{name}:{number}: not a record the reader takes ({str(exc).split(':')[0]})"
                ) from None


def _parquet(path: Path) -> Iterator[tuple[str, object]]:
    # local: pyarrow loads for a .parquet file only
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise RecipeError(f"{path}: not a readable Parquet file ({_arrow_reason(exc)})") from None
    row = 0
    for group in range(parquet.num_row_groups):
        try:
            records = parquet.read_row_group(group, use_threads=False).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise RecipeError(
                f"{path}: row group {group} (rows from {row:,}) cannot be read ({_arrow_reason(exc)})"
            ) from None
        for record in records:
            yield f"{path}: row {row}", record
            row += 1


def encode_file(path: Path, chat: ChatFormat, seq_len: int, limit: int | None = None) -> list[Encoded]:
    """Every record of ``path`` encoded (the first ``limit``); a record that is none, or longer
    than ``seq_len`` tokens, is a :class:`RecipeError` naming its file and line."""
    out = []
    for where, record in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            encoded = chat.encode(conversation(record))
        except ChatError as exc:
            kind = _json_kind(record) if not isinstance(record, dict) else None
            raise RecipeError(f"{where}: {exc if kind is None else f'a JSON {kind}, not a record'}") from None
        if len(encoded) > seq_len:
            raise RecipeError(
                f"{where}: the record is {len(encoded):,} tokens as rendered ({chat.describe()}), more than "
                f"data.seq_len {seq_len:,}; raise data.seq_len or shorten the record"
            )
        if not encoded.trained.any():
            raise RecipeError(f"{where}: its answer encodes to no token: nothing to train on")
        out.append(encoded)
    if not out:
        raise RecipeError(f"{path}: no records")
    return out


def shuffled(n: int, seed: int, salt: int) -> np.ndarray:
    """A permutation of ``range(n)``, a pure function of ``(seed, salt)``."""
    return np.random.default_rng([seed, salt]).permutation(n)
