"""Writing a file whole: a reader sees the old file or the new one, never part of one (the
tokenizer cache, token shards, a dataset folder's records, a generated dataset, the run log).
Torch-free."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from yamlformer.recipes.errors import RecipeError


def write_atomic(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so a reader sees the old file or the whole new one; a failed
    write leaves no temp file and is a :class:`RecipeError` naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()  # no partial file is left for a rerun to trip on
        if isinstance(exc, OSError):
            # local: builder.checkpoints loads only to name a failed write
            from yamlformer.builder.checkpoints import write_reason

            raise RecipeError(f"could not write {path}: {write_reason(exc)}") from None
        raise
