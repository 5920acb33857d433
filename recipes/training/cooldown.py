"""``builder train RECIPE --cooldown-from CKPT --steps N``: a cooldown branched from the stable
phase of a warmup-stable-decay run (MiniCPM; Hägele et al. 2024), in its own run folder.

The branch resumes everything the checkpoint holds (weights, optimizer state, data position,
history) and trains ``N`` more steps under the recipe's schedule made to decay over exactly
those steps: ``schedule.type: wsd`` with ``decay_steps: N`` and ``trainer.max_steps`` the
checkpoint's step plus ``N``. The learning rate of every step the checkpoint took is the same
under both schedules, which is what lets the resume through
(``yamlformer.recipes.training.run_folder.recipe_differences``). The folder is the stable run's
with ``-cooldown-STEP+N`` after it; the same command run again resumes the cooldown there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from yamlformer.builder.checkpoints import RESUMABLE, CheckpointError, exists, peek_meta
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.optim.schedule import wsd_decay_start
from yamlformer.recipes.recipe.located import LocatedRecipe
from yamlformer.recipes.tasks import load_recipe
from yamlformer.recipes.training.run import train_recipe

#: the schedules a cooldown branches from: a learning rate held constant after the warmup
BRANCHES_FROM = ("wsd", "constant")


def cooldown_folder(located: LocatedRecipe, step: int, steps: int) -> Path:
    """Where a cooldown of ``steps`` from the checkpoint at ``step`` runs: beside the stable run's folder."""
    out = located.out
    return out.with_name(f"{out.name}-cooldown-{step}+{steps}")


def branched(located: LocatedRecipe, ckpt: Path, step: int, steps: int) -> LocatedRecipe:
    """The recipe of the cooldown: its schedule decaying over the ``steps`` after ``step``, in
    its own folder. Refuses a schedule with no stable phase and a checkpoint outside it."""
    recipe = located.recipe
    schedule, trainer = recipe.schedule, recipe.trainer
    if schedule.type not in BRANCHES_FROM:
        raise RecipeError(
            f"--cooldown-from: the recipe's schedule is {schedule.type}; a cooldown branches from a constant "
            "learning rate: schedule.type wsd (warmup-stable-decay) or constant"
        )
    start = wsd_decay_start(schedule, trainer.max_steps) if schedule.type == "wsd" else trainer.max_steps
    if not schedule.warmup_steps <= step <= start:
        raise RecipeError(
            f"--cooldown-from: {ckpt} is at step {step}, outside the stable phase of the recipe's schedule "
            f"(steps {schedule.warmup_steps} to {start}); branch from a checkpoint taken in it"
        )
    decay = schedule.model_copy(update={"type": "wsd", "decay_steps": steps, "decay_fraction": None})
    folder = cooldown_folder(located, step, steps)
    trainer = trainer.model_copy(update={"max_steps": step + steps, "output_dir": str(folder)})
    return located.with_recipe(recipe.model_copy(update={"schedule": decay, "trainer": trainer}))


def checkpoint_step(ckpt: Path) -> int:
    """The optimizer step a checkpoint was written at (one line when it is not a run's checkpoint)."""
    try:
        step = peek_meta(ckpt).get("global_step")
    except CheckpointError as exc:
        raise RecipeError(f"--cooldown-from: {exc}") from None
    if not isinstance(step, int):
        raise RecipeError(f"--cooldown-from: {ckpt} records no optimizer step; give a checkpoint a run wrote")
    return step


def cooldown(
    recipe_path: str | Path,
    overrides: dict[str, Any] | None,
    ckpt: str | Path,
    steps: int,
    fresh: bool = False,
    samples: bool = True,
    verbose: bool = False,
    stop=None,
) -> dict:
    """Branch (or resume) the cooldown of ``steps`` steps from ``ckpt``; returns the run's summary
    (``stop``: as :func:`yamlformer.recipes.training.run.run`'s)."""
    ckpt = Path(ckpt)
    located = load_recipe(recipe_path, overrides)
    step = checkpoint_step(ckpt)
    branch = branched(located, ckpt, step, steps)
    folder = branch.out / "checkpoints"
    started = not fresh and any(exists(folder / name) for name in RESUMABLE)
    resume = None if started else str(ckpt)
    return train_recipe(branch, resume=resume, fresh=fresh, samples=samples, verbose=verbose, stop=stop)
