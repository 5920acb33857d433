"""A seeded run of each shipped recipe gives the losses it gave when they were recorded: four steps
of a tiny model in fp32 on generated stand-in data (the same on every machine), every step's
training loss and the last validation loss against ``tests/reference_losses.json``.

A refactor that changes no arithmetic passes this test; one that reorders the data, the
initialization, the optimizer or the loss fails it. Record new references only for a change that is
meant to change the numbers: ``BUILDER_RECORD_LOSSES=1 pytest tests/test_reference_losses.py``."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from data_helpers import REPO, data_for_recipes
from test_shipped_recipes import BASES, RECIPES, TINY, TRAINER

REFERENCES = Path(__file__).with_name("reference_losses.json")
STEPS = 4
#: every recipe on generated data (python-stdlib is the interpreter's own files, which differ by version)
DATA = {"lm-stdlib": {"data.dataset": "tinyshakespeare", "data.max_bytes": None}}


def _losses(out: Path) -> dict[str, list[float]]:
    (metrics,) = sorted(out.glob("logs/version_*/metrics.csv"))
    train, val = [], []
    with open(metrics, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("loss"):
                train.append(float(row["loss"]))
            if row.get("val_loss"):
                val.append(float(row["val_loss"]))
    return {"train": train, "val": val[-1:]}


#: every recipe that trains from scratch: one that starts from another's run (BASES) trains on its
#: losses and, for lora-stdlib, on records made from the running interpreter, which differ by version
OWN = [p for p in RECIPES if p.stem not in BASES]


@pytest.mark.parametrize("shipped", OWN, ids=[p.stem for p in OWN])
def test_a_seeded_run_gives_the_recorded_losses(shipped, tmp_path, monkeypatch):
    from yamlformer.recipes.training.run import run

    data_for_recipes(tmp_path / "data", monkeypatch, real=False)
    monkeypatch.chdir(tmp_path)
    model, settings = TINY[shipped.stem]
    overrides = {
        **TRAINER,
        **settings,
        **DATA.get(shipped.stem, {}),
        "trainer.precision": "32",
        "trainer.max_steps": STEPS,
        "trainer.val_check_interval": STEPS,
        "trainer.checkpoint_every_n_steps": STEPS,
        "trainer.output_dir": str(tmp_path / "run"),
        **{f"model.overrides.{k}": v for k, v in model.items()},
    }
    summary = run(REPO / "recipes" / shipped.name, overrides, samples=False)
    assert summary["steps"] == STEPS
    losses = _losses(Path(summary["output_dir"]))
    assert len(losses["train"]) == STEPS and len(losses["val"]) == 1, losses

    recorded = json.loads(REFERENCES.read_text()) if REFERENCES.is_file() else {}
    if os.environ.get("BUILDER_RECORD_LOSSES") == "1":
        recorded[shipped.stem] = losses
        REFERENCES.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    assert shipped.stem in recorded, f"no reference losses for {shipped.stem}: record them (see the module docstring)"
    expected = recorded[shipped.stem]
    for kind in ("train", "val"):
        assert losses[kind] == pytest.approx(expected[kind], rel=2e-5, abs=1e-6), kind
