"""Whether a run may resume the checkpoint it would start from, asked before any data or model
work (:func:`check_recipe_early`) by the run and by its dry run alike: refused when the recipe
or the resolved spec that shaped it differ from this run's (what may change:
:data:`yamlformer.recipes.training.run_folder.MAY_CHANGE`). Torch- and Lightning-free; the
run's final check, with the tokenizer and the corpus, is
:func:`yamlformer.recipes.training.run.resume_path`.
"""

from __future__ import annotations

from pathlib import Path

from yamlformer.builder.checkpoints import CheckpointError, exists, not_ours, peek_meta
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.training.run_folder import recipe_differences, recipe_dump, spec_differences


def given_checkpoint(resume: str) -> Path:
    """The checkpoint ``--resume PATH`` names; one line when there is none."""
    path = Path(resume)
    if not exists(path):
        raise RecipeError(f"--resume: no checkpoint at {path}")
    return path


def builder_meta(path: Path, checkpoint: dict) -> dict:
    """The ``builder`` record of a checkpoint a run resumes from; one line naming ``path`` when it
    has none (a checkpoint of another program: nothing to compare or continue)."""
    meta = checkpoint.get("builder")
    if isinstance(meta, dict):
        return meta
    raise RecipeError(
        f"{not_ours(path, checkpoint)}, so this run cannot resume from it: start over with "
        "--fresh, or set trainer.output_dir to a new folder"
    )


def trained_differently(path: Path, lines: list[str]) -> RecipeError:
    shown = "\n".join(f"  {line}" for line in lines)
    return RecipeError(
        f"{path} was trained with a different recipe:\n{shown}\nstart over with --fresh, "
        "or set trainer.output_dir to a new folder"
    )


def check_recipe_early(run, resume: str | bool | None = None, fresh: bool = False) -> Path | None:
    """Before any data or model work: the recipe and the resolved spec of the checkpoint a resume
    starts from (its pickle alone) against ``run``'s (a :class:`yamlformer.recipes.training.resolved.Run`;
    its paths absolute, as checkpoints keep them), so a changed field stops the run at once.
    Returns that checkpoint (None: a new run). The tokenizer and the corpus are checked once they
    exist, with the checkpoint verified (:func:`resume_path`)."""
    if fresh:
        return None
    path = given_checkpoint(resume) if isinstance(resume, str) else run.checkpoints / "last.ckpt"
    try:
        peeked = peek_meta(path)
        saved = builder_meta(path, peeked)
    except CheckpointError:
        return None  # none, or damaged: resume_path finds what to resume from and says so
    current = recipe_dump(run)
    refused, _ = recipe_differences(saved.get("recipe") or {}, current, step=peeked.get("global_step"))
    if isinstance(saved.get("spec"), dict):
        refused += spec_differences(saved["spec"], run.spec.model_dump(mode="json"))
    if refused:
        raise trained_differently(path, refused)
    return path
