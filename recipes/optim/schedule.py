"""Learning-rate schedules: the multiplier on every group's peak learning rate at each step
(the recipe's ``schedule:``), and which steps two schedules agree on (a resumed run may change
its schedule where every step it took had the same learning rate under both: a warmup-stable-
decay run lengthened, or a cooldown branched from its stable phase)."""

from __future__ import annotations

import math

#: wsd's decay share when neither decay_steps nor decay_fraction is given, and its default shape
WSD_FRACTION = 0.2
WSD_SHAPE = "1-sqrt"


def wsd_decay_start(schedule, max_steps: int) -> int:
    """The first step of a wsd schedule's decay: ``decay_steps`` (or ``decay_fraction`` of
    ``max_steps``) before the end, never inside the warmup."""
    length = schedule.decay_steps
    if length is None:
        length = round((schedule.decay_fraction or WSD_FRACTION) * max_steps)
    return max(schedule.warmup_steps, max_steps - length)


def _decay(shape: str, t: float) -> float:
    """A decay from 1 at ``t = 0`` to 0 at ``t = 1``."""
    if shape == "linear":
        return 1.0 - t
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    return 1.0 - math.sqrt(t)


def lr_multiplier(step: int, schedule, lr: float, max_steps: int) -> float:
    """The learning rate at ``step`` as a share of the peak ``lr``: a linear warmup, then
    nanoGPT's cosine, inverse square root, constant, or warmup-stable-decay."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    floor = schedule.min_lr / lr
    if schedule.type == "constant":
        return 1.0
    if schedule.type == "inverse_sqrt":
        return max(floor, math.sqrt(max(warmup, 1) / max(step, 1)))
    if schedule.type == "wsd":
        start = wsd_decay_start(schedule, max_steps)
        if step < start:
            return 1.0
        t = min(1.0, (step - start) / max(1, max_steps - start))
        return floor + _decay(schedule.decay_shape or WSD_SHAPE, t) * (1.0 - floor)
    decay = schedule.decay_steps or max_steps
    if step >= decay:
        return floor
    ratio = (step - warmup) / max(1, decay - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)


def same_through(saved, current, step: int) -> bool:
    """Whether two recipes' schedules (with their ``trainer.max_steps`` and peak learning rates)
    gave the same learning rate at every step before ``step``: the steps a checkpoint at
    ``step`` has taken."""
    a = (saved.schedule, saved.optimizer.peak_lr, saved.trainer.max_steps)
    b = (current.schedule, current.optimizer.peak_lr, current.trainer.max_steps)
    if a[1] != b[1]:
        return False
    if saved.schedule == current.schedule and saved.schedule.type not in ("cosine", "wsd"):
        return True  # the same schedule, which no step count changes
    return all(lr_multiplier(i, *a) == lr_multiplier(i, *b) for i in range(step))
