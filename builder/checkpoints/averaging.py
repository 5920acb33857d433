"""Checkpoint averaging (Vaswani et al. 2017, section 6.1: the base models average the last 5
checkpoints, written at 10-minute intervals): the kept ``step-N.ckpt`` checkpoints of a run, and
the average of their weights written as ``averaged.ckpt``.

The average is taken over every floating tensor of the ``state_dict`` in float64 and cast back;
integer tensors (counters, index buffers) must agree and are kept. ``averaged.ckpt`` has the
weights and the ``builder`` metadata of a training checkpoint but no optimizer state: it is for
``builder eval`` and ``builder generate``, not for resuming. Keeping the last N during training
is the Lightning callback ``yamlformer.recipes.tasks.translation.training.KeepLastCheckpoints``.
"""

from __future__ import annotations

import re
from pathlib import Path

from yamlformer.builder.checkpoints.format import BUILDER_KEY, STATE_KEY, CheckpointError
from yamlformer.builder.checkpoints.read import read_meta, read_weights
from yamlformer.builder.checkpoints.write import write_checkpoint

#: kept checkpoints are named by their optimizer step, so name order is step order
_STEP_NAME = re.compile(r"^step-(\d+)\.ckpt$")


def step_path(folder: str | Path, step: int) -> Path:
    """Where the checkpoint kept at optimizer step ``step`` is written."""
    return Path(folder) / f"step-{step:07d}.ckpt"


def kept_checkpoints(folder: str | Path) -> list[Path]:
    """The ``step-N.ckpt`` checkpoints (files or sharded folders) in ``folder``, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("step-*.ckpt") if (m := _STEP_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def average_state_dicts(state_dicts: list[dict]) -> dict:
    """The element-wise mean of like ``state_dicts`` (integer tensors must be equal)."""
    # local: torch loads to read or write one; telling checkpoints apart stays torch-free (validate, dry run)
    import torch

    if not state_dicts:
        raise CheckpointError("no checkpoints to average")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if list(sd) != keys:
            missing = sorted(set(keys) ^ set(sd))
            raise CheckpointError(f"checkpoint {i} holds other tensors than checkpoint 0 ({missing[:3]} ...)")
    out = {}
    for key in keys:
        tensors = [sd[key] for sd in state_dicts]
        first = tensors[0]
        if any(t.shape != first.shape for t in tensors):
            raise CheckpointError(f"{key}: shapes {[tuple(t.shape) for t in tensors]} differ; not one model")
        if first.is_floating_point():
            total = torch.zeros(first.shape, dtype=torch.float64)
            for t in tensors:
                total += t.to(torch.float64)
            out[key] = (total / len(tensors)).to(first.dtype)
        else:
            if any(not torch.equal(t, first) for t in tensors):
                raise CheckpointError(f"{key}: integer tensors differ between checkpoints; they cannot be averaged")
            out[key] = first.clone()
    return out


def average_checkpoints(paths: list[Path], out: str | Path) -> Path:
    """Write the average of the checkpoints ``paths`` to ``out`` (the metadata of the last one),
    each verified against its checksums: a damaged one is named, never averaged in."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    averaged = {
        key: value for key, value in read_meta(paths[-1]).items() if key in (BUILDER_KEY, "global_step", "epoch")
    }
    averaged[STATE_KEY] = average_state_dicts([read_weights(p) for p in paths])
    averaged[BUILDER_KEY] = dict(averaged.get(BUILDER_KEY) or {}, averaged_from=[Path(p).name for p in paths])
    return write_checkpoint(averaged, out)
