"""What a run prints, once: lines go to stdout on rank 0 only (every rank runs the same code)."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_only


def say(*args) -> None:
    if rank_zero_only.rank == 0:
        print(*args, flush=True)
