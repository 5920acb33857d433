"""``builder sweep --print-slurm``'s array job, submitted as printed to a real SLURM (the ``slurm``
fixture, tests/slurm_helpers.py): its two array tasks each claim a trial of the study and run it,
and both trials land in the study's database. ``python -m pytest -m launch``."""

from __future__ import annotations

import csv
import sys
import time

import pytest
import yaml
from recipe_helpers import tiny_recipe

from yamlformer.builder.cli import main

pytestmark = pytest.mark.launch
pytest.importorskip("optuna")


def test_the_sweeps_array_job_runs_both_trials_into_the_study(slurm, tmp_path, tmp_path_factory, capsys):
    cache = tmp_path_factory.getbasetemp() / "slurm-cache"
    recipe = tiny_recipe(tmp_path, data={"cache_dir": str(cache)})
    study = {
        "name": "s",
        "recipe": recipe.name,
        "axes": {"optimizer.lr": [1.0e-3, 3.0e-3]},
        "budget": {"steps": 4, "validations": 2},
        "parallel": {"trials": 2},
        "output_dir": str(tmp_path / "study"),
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    assert main(["sweep", str(path), "--max-trials", "0"]) == 0  # the study made once, as the script says
    capsys.readouterr()
    assert main(["sweep", str(path), "--print-slurm"]) == 0
    script = tmp_path / "sweep.sbatch"
    script.write_text(capsys.readouterr().out)
    text = script.read_text()
    assert "#SBATCH --array=0-1%2" in text and str(sys.prefix) in text  # the environment activated

    started = time.monotonic()
    job = slurm.submit(script)
    tasks = [f"{job}_{i}" for i in range(2)]
    for task in tasks:
        fields = slurm.finished(task, 300)
        log = next(tmp_path.glob(f"s-{job}_{task[-1]}.out"), None)
        assert fields["JobState"] == "COMPLETED", (fields, log.read_text()[-3000:] if log else None)
    seconds = time.monotonic() - started
    assert main(["study", "report", str(path), "--out", str(tmp_path / "report")]) == 0
    with (tmp_path / "report" / "trials.csv").open() as rows:
        trials = {row["variant"]: row for row in csv.DictReader(rows)}
    assert sorted(trials) == ["lr=0.001", "lr=0.003"], trials
    assert all(row["status"] == "complete" and float(row["final_val"]) > 0 for row in trials.values()), trials
    print(f"\nbuilder sweep --print-slurm, 2 trials as a 2-task array job: {seconds:.1f} s from submission")
