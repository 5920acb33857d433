"""A run folder explains itself: config.yaml is the resolved recipe, runs again to the same losses
and continues its own run; hparams.yaml holds it too; a resumed run continues the same CSV and
TensorBoard logs; and `builder eval` scores what the run's validations scored unless told
otherwise, and says so."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from data_helpers import stand_in_files
from recipe_helpers import history, tiny_recipe

TRAINER = {"max_steps": 8, "val_check_interval": 4, "checkpoint_every_n_steps": 4, "limit_val_batches": 2}


def _rows(out: Path) -> list[dict]:
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _versions(out: Path) -> dict[str, list[str]]:
    return {d: sorted(p.name for p in (out / d).iterdir()) for d in ("logs", "tensorboard")}


def test_config_yaml_is_the_resolved_recipe_and_runs_again(tmp_path, monkeypatch):
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import run

    inline = yaml.safe_load(tiny_recipe(tmp_path).read_text())["model"]["spec"]
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "tiny.yaml").write_text(yaml.safe_dump(inline))
    (tmp_path / "corpus.txt").write_bytes(stand_in_files("tinyshakespeare")["tinyshakespeare.txt"][:60_000])
    path = tiny_recipe(
        tmp_path,
        trainer=dict(TRAINER, output_dir="run"),  # relative paths: resolved in the config
        model={"spec": "specs/tiny.yaml", "overrides": {"decoder": {"n_layers": 1}}},
        data={"sources": ["corpus.txt"]},
    )
    monkeypatch.chdir(tmp_path)
    first = run(path, samples=False)
    out = tmp_path / "run"
    config = out / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    meta = torch.load(first["last"], map_location="cpu", weights_only=True)["builder"]
    assert saved["model"]["overrides"] == {} and "extends" not in saved["model"]["spec"]
    assert saved["model"]["spec"]["decoder"]["n_layers"] == 1
    assert saved["model"]["spec"]["vocab_size"] == meta["spec"]["vocab_size"]
    assert saved["data"]["cache_dir"] == str(tmp_path / "cache") and saved["trainer"]["output_dir"] == str(out)
    assert saved["trainer"]["max_steps"] == 8 and saved["data"]["sources"] == [str(tmp_path / "corpus.txt")]
    hparams = yaml.safe_load((out / "logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["trainer"]["max_steps"] == 8 and hparams["model"]["spec"]["d_model"] == 32

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the config holds no path relative to where the first run ran
    assert load_recipe(config).recipe.trainer.output_dir == str(out)
    again = run(config, {"trainer.output_dir": str(elsewhere / "again")}, samples=False)
    a, b = history(out / "checkpoints" / "last.ckpt"), history(Path(again["last"]))
    assert [x[1] for x in a["train"]] == [x[1] for x in b["train"]] and a["val"][-1][1] == b["val"][-1][1]
    again_meta = torch.load(again["last"], map_location="cpu", weights_only=True)["builder"]
    assert again_meta["spec"] == meta["spec"] and again_meta["tokenizer"] == meta["tokenizer"]

    # the config continues its own run, from anywhere: its paths and inline spec are this run's
    from yamlformer.builder.cli import main

    assert main(["train", str(config), "--no-samples", "--set", "trainer.max_steps=10"]) == 0
    steps = [step for step, _ in history(out / "checkpoints" / "last.ckpt")["train"]]
    assert steps[-1] == 10 and steps == sorted(set(steps))  # one entry per log interval, through step 10
    assert _versions(out) == {"logs": ["version_0"], "tensorboard": ["version_0"]}


def test_a_resumed_run_continues_its_logs(tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    path = tiny_recipe(tmp_path, trainer=TRAINER)
    out = tmp_path / "run"
    run(path, samples=False)
    stray = dict(_rows(out)[-1], step="9", loss="999.0")  # as a run killed after its last checkpoint logs
    with open(out / "logs" / "version_0" / "metrics.csv", "a", newline="") as f:
        csv.DictWriter(f, fieldnames=list(stray)).writerow(stray)

    run(path, {"trainer.max_steps": 12}, samples=False)
    assert "resuming from" in capsys.readouterr().out
    assert _versions(out) == {"logs": ["version_0"], "tensorboard": ["version_0"]}
    train_steps = [int(r["step"]) for r in _rows(out) if r["loss"]]
    assert (
        train_steps == sorted(set(train_steps))
        and train_steps[-1] == 11
        and "999.0" not in {r["loss"] for r in _rows(out)}
    )
    assert len([r for r in _rows(out) if r["val_loss"]]) == len(history(out / "checkpoints" / "last.ckpt")["val"])
    hparams = yaml.safe_load((out / "logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["trainer"]["max_steps"] == 12

    run(path, {"trainer.max_steps": 4}, fresh=True, samples=False)  # starting over: new logs beside the old
    assert _versions(out) == {"logs": ["version_0", "version_1"], "tensorboard": ["version_0", "version_1"]}


def test_eval_scores_the_runs_validation_by_default(tmp_path, capsys):
    from yamlformer.builder.cli import main
    from yamlformer.recipes.training.run import run

    summary = run(tiny_recipe(tmp_path, trainer=TRAINER), samples=False)
    capsys.readouterr()
    assert main(["eval", summary["last"]]) == 0
    captured = capsys.readouterr()
    first, second = captured.out.strip().splitlines()
    run_loss = history(Path(summary["last"]))["val"][-1][1]
    assert f"loss {run_loss:.4f}" in first  # the same windows as the run's validation: the same loss
    assert second.startswith(
        "scored 2 batches (the recipe's trainer.limit_val_batches: the windows the run's "
        "validations drew); --all scores the whole data once instead ("
    )
    assert "eval" in captured.err and "batch" in captured.err  # the progress bar

    assert main(["eval", summary["last"], "--json", "--max-batches", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["batches"] == 1 and one["tokens"] == 4 * 32
    assert main(["eval", summary["last"], "--json", "--all"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["batches"] == every["batches_available"] > 2 and every["tokens"] > 2 * 4 * 32
    for bad in (["--max-batches", "0"], ["--max-batches", "2", "--all"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", summary["last"], *bad])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-batches: takes an integer from 1 up, got '0'" in err and "not allowed with argument" in err
