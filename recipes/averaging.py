"""Checkpoint averaging (Vaswani et al. 2017, section 6.1: the base models average the last 5
checkpoints, written at 10-minute intervals): keep the last N during training, average their
weights into ``averaged.ckpt`` at the end.

The average is taken over every floating tensor of the ``state_dict`` in float64 and cast back;
integer tensors (counters, index buffers) must agree and are kept. ``averaged.ckpt`` has the
weights and the ``builder`` metadata of a training checkpoint but no optimizer state: it is for
``builder eval`` and ``builder generate``, not for resuming.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import lightning as L
import torch

from recipes.recipe.sections import RecipeError

#: kept checkpoints are named by their optimizer step, so name order is step order
_STEP_NAME = re.compile(r"^step-(\d+)\.ckpt$")


def average_state_dicts(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of like ``state_dicts`` (integer tensors must be equal)."""
    if not state_dicts:
        raise RecipeError("no checkpoints to average")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if list(sd) != keys:
            missing = sorted(set(keys) ^ set(sd))
            raise RecipeError(f"checkpoint {i} holds other tensors than checkpoint 0 ({missing[:3]} ...)")
    out = {}
    for key in keys:
        tensors = [sd[key] for sd in state_dicts]
        first = tensors[0]
        if any(t.shape != first.shape for t in tensors):
            raise RecipeError(f"{key}: shapes {[tuple(t.shape) for t in tensors]} differ; not one model")
        if first.is_floating_point():
            total = torch.zeros(first.shape, dtype=torch.float64)
            for t in tensors:
                total += t.to(torch.float64)
            out[key] = (total / len(tensors)).to(first.dtype)
        else:
            if any(not torch.equal(t, first) for t in tensors):
                raise RecipeError(f"{key}: integer tensors differ between checkpoints; they cannot be averaged")
            out[key] = first.clone()
    return out


def average_checkpoints(paths: list[Path], out: Path) -> Path:
    """Write the average of the checkpoints ``paths`` to ``out`` (the metadata of the last one)."""
    from builder.checkpoints import CheckpointError, read_meta, read_weights
    from recipes.checkpoint import write_checkpoint

    try:  # each verified against its checksums: a damaged one is named, never averaged in
        averaged = {
            key: value for key, value in read_meta(paths[-1]).items() if key in ("builder", "global_step", "epoch")
        }
        averaged["state_dict"] = average_state_dicts([read_weights(p) for p in paths])
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    averaged["builder"] = dict(averaged.get("builder") or {}, averaged_from=[Path(p).name for p in paths])
    return write_checkpoint(averaged, out)


def kept_checkpoints(dirpath: Path) -> list[Path]:
    """The ``step-N.ckpt`` checkpoints (files or sharded folders) in ``dirpath``, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(dirpath).glob("step-*.ckpt") if (m := _STEP_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


class KeepLastCheckpoints(L.Callback):
    """Weights every ``every_n_steps`` optimizer steps (and at the end) as ``step-N.ckpt``, the last
    ``keep`` of them kept; at the end of training their average goes to ``averaged.ckpt``."""

    def __init__(self, dirpath: Path, keep: int, every_n_steps: int):
        self.dirpath, self.keep, self.every_n_steps = Path(dirpath), keep, every_n_steps
        self.averaged_path = self.dirpath / "averaged.ckpt"

    def _save(self, trainer) -> None:
        from builder.checkpoints import exists

        path = self.dirpath / f"step-{trainer.global_step:07d}.ckpt"
        if exists(path):
            return
        trainer.save_checkpoint(path, weights_only=True)
        if trainer.is_global_zero:
            for old in kept_checkpoints(self.dirpath)[: -self.keep]:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step == 0:
            return
        self._save(trainer)
        if trainer.is_global_zero:
            average_checkpoints(kept_checkpoints(self.dirpath), self.averaged_path)
