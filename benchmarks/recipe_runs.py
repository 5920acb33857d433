"""What the optimizer benchmarks share: a shipped recipe trained in this process into a folder of
its own, its validation curve read back from the checkpoint's history, and where a curve first
reaches a loss (steps and wall seconds, interpolated between validations)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the datasets come through the registry (recipes/data/registry.py): BUILDER_DATA, else a checkout's
# local copy at ../shared/data when there is one, else downloaded once into the user cache
if (REPO.parent / "shared" / "data").is_dir():
    os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))


def history(summary: dict) -> dict:
    """The run's ``{"train": [(step, loss)], "val": [(step, loss, wall seconds)]}``, from its last checkpoint."""
    import torch

    return torch.load(summary["last"], map_location="cpu", weights_only=True)["builder"]["history"]


def train(recipe: str | Path, overrides: dict, folder: Path) -> dict:
    """``builder train RECIPE`` with ``overrides`` into ``folder`` (fresh), no samples; its summary
    and its validation curve."""
    from yamlformer.recipes.training.run import run

    summary = run(recipe, {**overrides, "trainer.output_dir": str(folder)}, fresh=True, samples=False)
    return {**summary, "val_curve": history(summary)["val"]}


def reaches(curve: list, target: float) -> tuple[float, float] | None:
    """The first ``(step, wall seconds)`` at which a validation curve ``[(step, loss, wall)]`` is at
    or below ``target``, linearly interpolated between the two validations around it; None when it
    never gets there."""
    previous = None
    for step, loss, wall in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step), float(wall)
            share = (previous[1] - target) / (previous[1] - loss)
            return previous[0] + share * (step - previous[0]), previous[2] + share * (wall - previous[2])
        previous = (step, loss, wall)
    return None


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--folder", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--out", help="also write the result here (JSON)")


def runs_folder(args: argparse.Namespace, prefix: str) -> Path:
    """``--folder``, else a new temporary folder."""
    return Path(args.folder or tempfile.mkdtemp(prefix=prefix))
