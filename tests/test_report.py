"""`builder report RUN`: a real tiny run's folder drawn alone: the PNG decodes at its size with
every panel drawn, the HTML page names each series and carries the CSV's values; a folder that
is not a run, a wrong output and a missing matplotlib are one line each."""

from __future__ import annotations

import csv
import re
import sys

import pytest
from recipe_helpers import tiny_recipe

from yamlformer.builder.cli import main

plt = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is not installed (pip install 'yamlformer[plot]')")

TRAINER = {"max_steps": 6, "val_check_interval": 3, "checkpoint_every_n_steps": 3, "limit_val_batches": 2}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    from yamlformer.recipes.training.run import run

    tmp = tmp_path_factory.mktemp("report")
    run(tiny_recipe(tmp, trainer=dict(TRAINER, log_every_n_steps=1, loggers={"tensorboard": False})), samples=False)
    return tmp / "run"


def _csv(folder, key: str) -> list[float]:
    with open(folder / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def test_the_png_and_the_page_show_the_runs_curves(run_folder, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert main(["report", str(run_folder), "-o", str(png), "--html"]) == 0
    assert capsys.readouterr().out.split() == [str(png), str(png.with_suffix(".html"))]

    image = plt.imread(png)
    assert image.shape[:2] == (800, 1200)
    height, width = image.shape[:2]
    for rows in (slice(0, height // 2), slice(height // 2, height)):
        for cols in (slice(0, width // 2), slice(width // 2, width)):
            panel = image[rows, cols, :3]
            assert (panel < 0.5).mean() > 0.005  # lines, axes and labels drawn in each of the 4 panels

    page = png.with_suffix(".html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "<script" not in page
    for series in ("loss", "val_loss", "lr", "tok/s", "process peak RSS", "estimate per rank"):
        assert f">{series}<" in page or f"{series}</text>" in page, series  # the legends' text, kept as text
    table = dict(re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td>", page))
    assert float(table["loss"]) == pytest.approx(_csv(run_folder, "loss")[-1], rel=1e-5)
    assert float(table["val_loss"]) == pytest.approx(_csv(run_folder, "val_loss")[-1], rel=1e-5)
    assert float(table["lr"]) == pytest.approx(_csv(run_folder, "lr")[-1], rel=1e-5)
    assert "estimated memory per rank" in page


def test_the_default_output_is_in_the_run_folder(run_folder, capsys):
    assert main(["report", str(run_folder)]) == 0
    assert capsys.readouterr().out.strip() == str(run_folder / "report.png")
    assert plt.imread(run_folder / "report.png").shape[:2] == (800, 1200)


def test_what_cannot_be_drawn_is_one_line(run_folder, tmp_path, monkeypatch, capsys):
    for argv, says in (
        ([str(tmp_path)], "no logs/version_N/metrics.csv"),
        ([str(tmp_path / "nothing")], "not a folder"),
        ([str(run_folder), "-o", str(tmp_path / "x.jpg")], "give a .png file"),
    ):
        assert main(["report", *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("builder report: ") and says in err[0], err

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    assert main(["report", str(run_folder)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["builder report: matplotlib is not installed: pip install 'yamlformer[plot]'"]
