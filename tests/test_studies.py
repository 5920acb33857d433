"""Variant studies (recipes/studies/): the study file and its variants checked before any trial, the
Optuna store (locked, foreign and redefined databases), the sweep's trials (crash, hang, prune,
a kill and a resume that reruns nothing finished), the report and the scaling-law fit.

Trials here are a stand-in process (``FAKE``) that writes a run's ``metrics.csv`` as ``builder train``
does, so the sweep's own logic runs in seconds; ``test_real_sweep_killed_and_resumed`` (slow) runs
real ``builder train`` trials.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("scipy")

from recipe_helpers import one_error_line, tiny_recipe

from yamlformer.builder.cli import main
from yamlformer.recipes.studies import report, runner, scaling, store
from yamlformer.recipes.studies.schema import load_study
from yamlformer.recipes.studies.variants import plan

#: a stand-in for `builder train`: validations of a made-up loss, appended to the run's metrics.csv;
#: SIGTERM "saves" the steps done (resumed from there); mode crash fails, hang never ends
FAKE = """
import json, os, signal, sys, time
out, mode, steps, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
os.makedirs(out + "/logs/version_0", exist_ok=True)
saved = out + "/saved"
start = int(open(saved).read()) if os.path.exists(saved) else 0
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
if mode == "crash":
    print("builder train: data.sources: no such file: /nowhere/corpus.txt", file=sys.stderr)
    sys.exit(1)
metrics = out + "/logs/version_0/metrics.csv"
if not os.path.exists(metrics):
    open(metrics, "w").write("TFLOP/s,epoch,loss,step,tok/s,val_loss\\n")
for step in range(start + 1, steps + 1):
    time.sleep(0.25 if mode != "hang" else 100)
    with open(metrics, "a") as f:
        f.write(f",0,,{step - 1},,{base + 1.0 / step}\\n")
    if stop:
        open(saved, "w").write(str(step))
        sys.exit(1)
open(saved, "w").write(str(steps))
"""


@pytest.fixture
def fake_trials(tmp_path, monkeypatch):
    """Trials run :data:`FAKE`: the variant's d_model sets its loss; d_model 48 crashes, 40 hangs."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    runs = []

    def command(loaded, variant, devices=0, python=None):
        d_model = variant.values.get("d_model", 32)
        mode = {48: "crash", 40: "hang"}.get(d_model, "ok")
        runs.append(variant.name)
        out = runner.trial_dir(loaded, variant.name).resolve()
        return [sys.executable, str(script), str(out), mode, str(variant.steps or 4), str(3.0 + 32 / d_model)]

    monkeypatch.setattr(runner, "train_command", command)
    monkeypatch.setattr(runner, "POLL", 0.05)
    monkeypatch.setattr(runner, "STOP_GRACE", 4.0)  # a hung trial ignores SIGTERM: killed after 1 s
    return runs


def write_study(tmp_path: Path, **fields) -> Path:
    recipe = tiny_recipe(tmp_path)
    study = {
        "name": "s",
        "recipe": recipe.name,
        "axes": {"d_model": [32, 64], "optimizer.lr": [1.0e-3, 3.0e-3]},
        "budget": {"steps": 4, "validations": 2},
        "output_dir": str(tmp_path / "study"),
        **fields,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def sweep(path: Path, *extra: str) -> int:
    return main(["sweep", str(path), *extra])


# -- the study file and its variants, before any trial ---------------------------------------------


def test_variants_are_counted_and_budgeted_by_flops(tmp_path):
    path = write_study(tmp_path, budget={"flops": [1.0e9, 4.0e9]})
    variants, invalid = plan(load_study(path))
    assert len(variants) == 8 and not invalid
    for v in variants:
        assert v.steps == -(-int(v.budget["flops"]) // (v.flops_per_token * v.tokens_per_step))
        assert v.overrides["trainer.max_steps"] == v.steps and v.family.startswith("d_model=")
    small, big = (next(v for v in variants if v.values["d_model"] == d and v.budget["flops"] == 1e9) for d in (32, 64))
    assert small.params < big.params and small.steps > big.steps  # the same FLOPs buy the smaller model more steps


def test_an_axis_naming_no_field_is_one_located_line_with_did_you_mean(tmp_path, capsys):
    path = write_study(tmp_path, axes={"optimizer.lrr": [1.0e-3, 3.0e-3]})
    assert sweep(path, "--dry-run") == 1
    err = capsys.readouterr().err
    assert err.strip() == f"{path}:4:3: axes.optimizer.lrr: unknown key 'lrr'; did you mean 'lr'?", err


def test_an_impossible_variant_is_named_before_any_trial_and_the_rest_run(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path, axes={"d_model": [32, 33]})  # 33 is not a multiple of the 2 heads
    assert sweep(path) == 0
    out = capsys.readouterr()
    bad = one_error_line(out.err, f"{path}: variant d_model=33")
    assert "not a multiple of n_heads" in bad and "Traceback" not in out.out
    assert fake_trials == ["d_model=32"]  # the possible one ran; the other never started
    table = {r["variant"]: r for r in report.rows(load_study(path), open_db(path))}
    assert table["d_model=33"]["status"] == "invalid" and table["d_model=32"]["status"] == "complete"


def test_named_variants_are_an_axis_and_a_bad_one_is_located(tmp_path, capsys):
    variants = {"small": {"d_model": 32}, "wide": {"d_model": 64, "decoder.ffn.hidden_dimm": 128}}
    path = write_study(tmp_path, axes={"optimizer.lr": [1.0e-3]}, variants=variants)
    assert sweep(path, "--dry-run") == 0
    out = capsys.readouterr()
    line = one_error_line(out.err, f"{path}: variant lr=0.001-variant=wide cannot run:")
    assert "variants.wide.decoder.ffn.hidden_dimm: unknown key 'hidden_dimm'; did you mean 'hidden_dim'?" in line
    assert f"{path}:" in line.split("cannot run: ")[1]
    assert [v.name for v in plan(load_study(path))[0]] == ["lr=0.001-variant=small"]


def test_a_bad_study_file_is_located(tmp_path, capsys):
    path = write_study(tmp_path, budget={"steps": 4, "flops": 1.0e9})
    assert sweep(path, "--dry-run") == 1
    assert "budget: give exactly one of steps, tokens, flops, minutes" in one_error_line(
        capsys.readouterr().err, f"{path}:"
    )
    path = write_study(tmp_path, search="tpe")
    assert sweep(path, "--dry-run") == 1
    assert "set total.trials" in capsys.readouterr().err


class _Checked(Exception):
    """Raised by a stand-in for a variant's check: the sweep was about to check variants."""


def _refuse_checks(monkeypatch, after: int = 0) -> list:
    """Variant checks counted, the ``after + 1``-th raising :class:`_Checked` (a grid of 10^6
    variants would otherwise take hours to fail on code that checks them all)."""
    from yamlformer.recipes.studies import variants

    done, real = [], variants.check

    def check(loaded, values):
        done.append(values)
        if len(done) > after:
            raise _Checked
        return real(loaded, values)

    monkeypatch.setattr(variants, "check", check)
    return done


def test_a_grid_too_large_to_check_is_refused_by_its_size_at_once(tmp_path, capsys, monkeypatch):
    """A 10^6-variant grid printed nothing for minutes: it is refused by name before any check."""
    checked = _refuse_checks(monkeypatch)
    ten = [round(0.001 * (i + 1), 4) for i in range(10)]
    axes = dict.fromkeys(("optimizer.lr", "optimizer.weight_decay", "schedule.min_lr"), ten)
    path = write_study(
        tmp_path, axes={**axes, "optimizer.eps": ten, "loss.label_smoothing": ten, "data.val_fraction": ten}
    )
    started = time.monotonic()
    assert sweep(path, "--dry-run") == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"{path}:3:1: axes: 1,000,000 variants (lr 10 x weight_decay 10 x min_lr 10 x eps 10 x label_smoothing 10 "
        "x val_fraction 10), more than a study checks before it runs (1,000); narrow the axes, or draw "
        "total.trials of them with search: random or tpe"
    ), err
    assert not checked and time.monotonic() - started < 30


def test_checking_many_variants_shows_progress_on_a_terminal(tmp_path, monkeypatch):
    import io

    from yamlformer.recipes.studies import variants

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    real = variants.check
    monkeypatch.setattr(variants, "check", lambda loaded, values: (time.sleep(0.4), real(loaded, values))[1])
    monkeypatch.setattr(sys, "stderr", Terminal())
    found, _ = plan(load_study(write_study(tmp_path)), progress=True)
    assert len(found) == 4 and "checking variants" in sys.stderr.getvalue()


def test_a_server_without_its_driver_is_refused_before_the_variants_are_checked(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sqlalchemy")
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the MySQL driver is installed here")
    checked = _refuse_checks(monkeypatch)
    path = write_study(tmp_path, storage="mysql://user:secret@localhost/study")
    assert sweep(path) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:") and "storage: a mysql:// database needs the Python driver 'MySQLdb'" in err
    assert err.count("\n") == 1 and "secret" not in err and not checked


def test_showing_a_study_never_run_makes_no_database(tmp_path, capsys):
    path = write_study(tmp_path)
    for command in ("show", "report"):
        assert main(["study", command, str(path)]) == 1
        assert "no study database (run `builder sweep" in one_error_line(capsys.readouterr().err, "builder study")
    assert not (tmp_path / "study" / "study.db").exists()


def test_a_range_or_an_axis_that_cannot_be_is_one_located_line(tmp_path, capsys):
    ranged = {"optimizer.lr": {"low": 0.1, "high": 0.01}}
    path = write_study(tmp_path, search="random", total={"trials": 2}, axes=ranged)
    assert sweep(path, "--dry-run") == 1
    assert capsys.readouterr().err.strip() == f"{path}:5:5: axes.optimizer.lr: low 0.1 must be less than high 0.01"
    path = write_study(tmp_path, axes={"optimizer.lr": [0.1], "d_model": []})
    assert sweep(path, "--dry-run") == 1
    assert capsys.readouterr().err.strip() == f"{path}:6:12: axes.d_model: an axis needs at least one value"


def test_launch_lines(tmp_path, capsys):
    path = write_study(tmp_path, parallel={"trials": 2, "devices": 2})
    assert sweep(path, "--print-torchrun") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(
        x.startswith("torchrun --standalone --nproc-per-node=2 -m yamlformer.builder.cli train ") for x in lines
    )
    assert all("trainer.max_steps=4" in x and "trainer.devices=2" in x for x in lines)
    assert sweep(path, "--print-slurm") == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --gpus-per-task=2" in script
    assert script.rstrip().endswith("--max-trials 1")


# -- the store -------------------------------------------------------------------------------------


def open_db(path: Path):
    return store.open_study(load_study(path), create=False)[0]


def test_a_locked_database_is_one_line(tmp_path, capsys, monkeypatch):
    path = write_study(tmp_path)
    assert sweep(path, "--max-trials", "0") == 0
    monkeypatch.setenv("BUILDER_STUDY_DB_TIMEOUT", "0.2")
    holder = sqlite3.connect(tmp_path / "study" / "study.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert sweep(path) == 1
    finally:
        holder.close()
    line = one_error_line(capsys.readouterr().err, "builder sweep:")
    assert "locked by another process" in line and "study.db" in line


def test_a_database_of_another_study_or_definition_or_program(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path, axes={"d_model": [32]})
    assert sweep(path, "--max-trials", "0") == 0
    capsys.readouterr()
    other = write_study(tmp_path, name="other", axes={"d_model": [32]})  # the same output_dir
    assert sweep(other) == 1
    assert "the database of another study ('s'), not 'other'" in one_error_line(
        capsys.readouterr().err, "builder sweep:"
    )
    changed = write_study(tmp_path, axes={"d_model": [32, 64]})
    assert sweep(changed) == 1
    assert "made from another definition (axes differ" in one_error_line(capsys.readouterr().err, "builder sweep:")
    (tmp_path / "study" / "study.db").write_bytes(b"not sqlite at all" * 100)
    assert main(["study", "show", str(path)]) == 1
    assert "not a study database" in one_error_line(capsys.readouterr().err, "builder study show:")
    (tmp_path / "study" / "study.db").unlink()
    with sqlite3.connect(tmp_path / "study" / "study.db") as db:
        db.execute("CREATE TABLE notes (text)")
    assert sweep(path) == 1
    assert "a database of another program" in one_error_line(capsys.readouterr().err, "builder sweep:")
    assert fake_trials == []


# -- trials ---------------------------------------------------------------------------------------


def test_crash_and_hang_fail_with_one_line_and_the_study_goes_on(tmp_path, capsys, fake_trials):
    path = write_study(
        tmp_path, axes={"d_model": [48, 40, 32]}, budget={"steps": 4, "validations": 2, "time_limit": 0.03}
    )
    assert sweep(path) == 0
    table = {r["variant"]: r for r in report.rows(load_study(path), open_db(path))}
    assert table["d_model=48"]["status"] == "failed"
    assert table["d_model=48"]["error"] == "builder train: data.sources: no such file: /nowhere/corpus.txt"
    assert table["d_model=40"]["status"] == "failed"
    assert table["d_model=40"]["error"] == "ran past its time limit of 0.03 min; killed"
    assert table["d_model=32"]["status"] == "complete" and table["d_model=32"]["final_val"] == pytest.approx(4.25)
    capsys.readouterr()
    assert main(["study", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "trial 0 (d_model=48) failed: builder train: data.sources: no such file" in out, out


def test_a_failed_trial_runs_again_with_retry_failed(tmp_path, capsys, fake_trials, monkeypatch):
    path = write_study(tmp_path, axes={"d_model": [48, 32]})
    assert sweep(path) == 0
    out = capsys.readouterr().out
    assert (
        f"1 complete, 1 failed; `builder study report {path}` shows them; `builder sweep {path} --retry-failed`" in out
    )
    assert sweep(path) == 0 and fake_trials.count("d_model=48") == 1  # a plain rerun leaves a failure alone
    capsys.readouterr()
    made = runner.train_command  # the fault is gone (a file another process held, a node that died)
    monkeypatch.setattr(runner, "train_command", lambda *a, **k: ["ok" if x == "crash" else x for x in made(*a, **k)])
    assert sweep(path, "--retry-failed") == 0
    out = capsys.readouterr().out
    assert "1 failed trials run again" in out and "2 complete;" in out and "--retry-failed" not in out
    assert fake_trials.count("d_model=48") == 2
    table = {r["variant"]: r for r in report.rows(load_study(path), open_db(path))}
    assert table["d_model=48"]["status"] == "complete" and table["d_model=48"]["final_val"] == pytest.approx(
        3.0 + 32 / 48 + 1 / 4
    )


def test_a_killed_study_resumes_without_rerunning_finished_trials(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path, axes={"d_model": [32, 64, 128, 256]}, parallel={"trials": 2})
    trials = tmp_path / "study" / "trials"

    def kill_midway():  # once the first trial has finished, while the next ones run
        while not any(p.read_text() == "4" for p in trials.glob("*/saved")):
            time.sleep(0.02)
        time.sleep(0.4)
        os.kill(os.getpid(), signal.SIGINT)

    killer = threading.Thread(target=kill_midway)
    killer.start()
    assert sweep(path) == 130
    killer.join()
    first = {r["variant"]: r["status"] for r in report.rows(load_study(path), open_db(path))}
    assert sorted(first.values()).count("complete") >= 1 and "interrupted" in first.values(), first
    ran = list(fake_trials)
    assert sweep(path) == 0
    again = fake_trials[len(ran) :]
    finished_before = {v for v, s in first.items() if s == "complete"}
    assert not finished_before & set(again), (first, again)  # nothing finished ran twice
    rows = report.rows(load_study(path), open_db(path))
    assert [r["status"] for r in rows] == ["complete"] * 4
    for row in rows:  # an interrupted trial resumed where it stopped: every validation once
        assert [s for s, _ in row["curve"]] == [1, 2, 3, 4], row
    assert "interrupted trials resume" in capsys.readouterr().out


def test_the_pruner_stops_hopeless_trials(tmp_path, fake_trials):
    path = write_study(
        tmp_path,
        axes={"d_model": [128, 96, 64, 16]},  # the worst (d_model 16) comes last
        pruner={"type": "median", "warmup": 0, "min_trials": 2},
        budget={"steps": 4, "validations": 4},
    )
    assert sweep(path) == 0
    table = {r["variant"]: r for r in report.rows(load_study(path), open_db(path))}
    assert table["d_model=16"]["status"] == "pruned" and len(table["d_model=16"]["curve"]) < 4
    assert table["d_model=128"]["status"] == "complete"


def test_tpe_search_draws_its_trials_from_ranges_and_lists(tmp_path, fake_trials):
    axes = {"d_model": [16, 32, 64], "optimizer.lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}}
    path = write_study(tmp_path, search="tpe", axes=axes, total={"trials": 5}, budget={"steps": 2})
    assert sweep(path) == 0
    rows = report.rows(load_study(path), open_db(path))
    assert len(rows) == 5 and {r["status"] for r in rows} == {"complete"}
    assert all(1e-4 <= r["optimizer.lr"] <= 1e-2 and r["d_model"] in (16, 32, 64) for r in rows)
    assert sweep(path) == 0 and len(report.rows(load_study(path), open_db(path))) == 5  # its 5 are drawn


# -- report and fit --------------------------------------------------------------------------------


def test_report_table_pareto_plots_and_exports(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path)
    assert sweep(path) == 0
    capsys.readouterr()
    assert main(["study", "report", str(path)]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "study" / "report"
    for name in ("trials.csv", "trials.json", "loss-vs-flops.png", "loss-curves.png", "sensitivity-lr.png"):
        assert (folder / name).stat().st_size > 0, name
    exported = json.loads((folder / "trials.json").read_text())
    assert len(exported["trials"]) == 4 and exported["pareto"]
    assert "Pareto front" in out and "d_model" in out
    rows = report.rows(load_study(path), open_db(path))
    front = report.pareto(rows)
    assert all(a["flops"] < b["flops"] and a["final_val"] > b["final_val"] for a, b in zip(front, front[1:]))


def test_a_study_ranks_by_a_downstream_metric(tmp_path, capsys):
    path = write_study(tmp_path, downstream={"tasks": ["lines"]}, rank_by="lines/acc")
    loaded = load_study(path)
    rows = [
        {"trial": n, "status": "complete", "final_val": loss, "downstream": {"lines/acc": acc}}
        for n, loss, acc in ((0, 3.0, 0.4), (1, 2.5, 0.3), (2, 2.0, 0.5))
    ] + [{"trial": 3, "status": "failed", "final_val": None, "downstream": {}}]
    assert [r["trial"] for r in report.ranked(loaded, rows)] == [2, 0, 1, 3]
    bad = write_study(tmp_path, rank_by="lines/acc")
    assert sweep(bad, "--dry-run") == 1
    assert "rank_by: 'lines/acc' is val_loss or TASK/METRIC of a downstream task" in capsys.readouterr().err


CHINCHILLA = scaling.Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def test_the_fit_recovers_a_known_law_within_its_bootstrap_intervals():
    rng = np.random.default_rng(1)
    params, tokens = (g.ravel() for g in np.meshgrid(np.logspace(5, 8, 6), np.logspace(7, 10, 6)))
    losses = CHINCHILLA.loss(params, tokens) * np.exp(rng.normal(0, 0.005, params.shape))
    fitted = scaling.fit(params, tokens, losses, bootstrap=60, seed=0)
    for name, (low, high) in fitted.intervals(0.99).items():
        true, got = getattr(CHINCHILLA, name), getattr(fitted.law, name)
        assert low <= true <= high, (name, low, true, high)
        assert low <= got <= high
        assert abs(got - true) / true < 0.1, (name, got, true)


def test_compute_optimal_minimises_the_law_at_its_budget():
    compute = 1e21
    n_opt, d_opt = CHINCHILLA.optimal(compute)
    assert 6 * n_opt * d_opt == pytest.approx(compute)
    sizes = n_opt * np.logspace(-0.5, 0.5, 101)
    losses = CHINCHILLA.loss(sizes, compute / 6 / sizes)
    assert sizes[int(np.argmin(losses))] == pytest.approx(n_opt, rel=0.03)
    family = [{"params": n, "flops_per_token": 6 * n, "family": str(n)} for n in (n_opt / 10, n_opt * 1.2, n_opt * 10)]
    assert scaling.best_member(CHINCHILLA, family, compute)["family"] == str(n_opt * 1.2)
    # one pass over a corpus of fewer tokens than the optimum trains on: the pick is the best model
    # that does not repeat it (here the largest: the others would train on more), none is a ValueError
    corpus = compute / 6 / (n_opt * 1.2) * 0.5
    assert scaling.best_member(CHINCHILLA, family, compute, max_tokens=corpus)["family"] == str(n_opt * 10)
    with pytest.raises(ValueError, match="--max-tokens .* every model of the study trains on more"):
        scaling.best_member(CHINCHILLA, family, compute, max_tokens=compute / 6 / (n_opt * 10) / 2)


def test_a_model_is_named_by_its_best_tuning_at_its_largest_budget():
    from yamlformer.recipes.commands.study import _members

    def row(family, flops, final_val, status="complete", params=1000):
        return {"params": params, "flops_per_token": 6000, "family": family, "flops": flops,
                "final_val": final_val, "status": status}  # fmt: skip

    table = [
        row("lr=1e-3", 1e12, 3.0),
        row("lr=2e-3", 1e12, 2.9),
        row("lr=1e-3", 1e10, 2.0),  # lower, but at a smaller budget
        row("lr=4e-3", 1e13, None, status="failed"),  # not finished
        row("lr=1e-3", 1e10, 4.0, params=2000),
    ]
    assert {m["params"]: m["family"] for m in _members(table)} == {1000: "lr=2e-3", 2000: "lr=1e-3"}


def test_a_fit_of_too_few_runs_is_one_line(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path)
    assert sweep(path) == 0
    capsys.readouterr()
    assert main(["study", "fit", str(path)]) == 1
    assert "needs at least 5 runs" in one_error_line(capsys.readouterr().err, "builder study fit:")


def test_fit_answers_a_budget_and_predicts_a_variant(tmp_path, capsys, fake_trials):
    path = write_study(tmp_path, axes={"d_model": [16, 32, 64, 128]}, budget={"steps": [2, 3, 4], "validations": 1})
    assert sweep(path) == 0
    capsys.readouterr()
    args = ["study", "fit", str(path), "--flops", "1e12", "--predict", "d_model=256", "--tokens", "1e5"]
    assert main([*args, "--bootstrap", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["points"] == 12 and set(result["law"]) == {"E", "A", "B", "alpha", "beta"}
    assert result["budget"]["nearest"]["family"].startswith("d_model=")
    assert result["prediction"]["params"] > max(r["params"] for r in report.rows(load_study(path), open_db(path)))
    assert main([*args, "--bootstrap", "10"]) == 0
    out = capsys.readouterr().out
    assert "fitted to 12 runs" in out and "the study's spec for it: d_model=" in out and "predicted loss" in out
    # --max-tokens: the spec picked among the models that do not repeat a corpus of that many tokens;
    # at the fewest any model trains on only that one is, below it none (one line)
    fewest = 1e12 / max(r["flops_per_token"] for r in report.rows(load_study(path), open_db(path)))
    assert main([*args, "--bootstrap", "10", "--json", "--max-tokens", repr(fewest * (1 + 1e-9))]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["nearest"]["tokens"] == pytest.approx(fewest)
    assert main([*args, "--bootstrap", "10", "--max-tokens", repr(fewest / 2)]) == 1
    assert "every model of the study trains on more" in one_error_line(capsys.readouterr().err, "builder study fit:")
    # --gpu-hours on --gpus GPUs: each model's tokens are the hours x the GPUs x builder plan's
    # predicted tokens/s per GPU for its fastest layout, so the budget in FLOPs is the chosen
    # model's own and its MFU the prediction's; a fixed --mfu gives hours x peak x MFU instead
    from yamlformer.builder.analysis.hardware import Cluster
    from yamlformer.builder.analysis.hardware import gpu as hardware_gpu
    from yamlformer.builder.analysis.plan import plan
    from yamlformer.recipes.studies.variants import variant_model

    fit = ["study", "fit", str(path), "--bootstrap", "10", "--json"]
    assert main([*fit, "--gpu-hours", "2", "--gpus", "8", "--gpu", "h100"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    near = budget["nearest"]
    resolution, spec, _ = variant_model(load_study(path), {"d_model": int(near["family"].split("=")[1])})
    recipe = resolution.recipe
    row = hardware_gpu("h100")
    cluster = Cluster(gpus=8, per_node=8, memory=row.memory, peak=row.peak["bf16"], gpu=row.name, hardware=row)
    batch = recipe.data.batch_size * recipe.trainer.accumulate_grad_batches
    step = plan(spec, cluster, seq_len=recipe.data.seq_len, global_batch=-(-batch // 8) * 8).chosen.prediction
    tokens = 2 * 3600 * 8 * step.tokens_per_s_per_gpu
    assert near["tokens"] == pytest.approx(tokens) and budget["flops"] == pytest.approx(
        tokens * near["flops_per_token"]
    )
    assert near["mfu"] == pytest.approx(step.mfu) and 0 < near["mfu"] < 1
    assert main([*fit, "--gpu-hours", "2", "--gpu", "H100 SXM", "--mfu", "0.5"]) == 0
    fixed = json.loads(capsys.readouterr().out)["budget"]
    assert fixed["flops"] == pytest.approx(2 * 3600 * row.peak["bf16"] * 0.5) and "mfu" not in fixed["nearest"]


@pytest.mark.slow
def test_real_sweep_killed_and_resumed(tmp_path):
    """Real `builder train` trials: the sweep process is sent SIGINT midway, and the rerun
    finishes the study without rerunning a finished trial."""
    import subprocess

    from recipe_helpers import builder_process

    path = write_study(tmp_path, axes={"d_model": [16, 32], "optimizer.lr": [1.0e-3, 3.0e-3]}, budget={"steps": 24})
    sweep_process = builder_process("sweep", str(path), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not any((tmp_path / "study" / "trials").glob("*/loss.png")):
        time.sleep(1)  # a trial has finished (its loss curve is written at its end)
    time.sleep(3)
    sweep_process.send_signal(signal.SIGINT)
    out, _ = sweep_process.communicate(timeout=120)
    assert sweep_process.returncode == 130, out
    done = {r["variant"] for r in report.rows(load_study(path), open_db(path)) if r["status"] == "complete"}
    again = builder_process("sweep", str(path), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out
    assert not any(f"start: {name} " in out for name in done), out
    assert [r["status"] for r in report.rows(load_study(path), open_db(path))] == ["complete"] * 4


def test_study_file_example_plans():
    example = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "examples" / "tiny-lm.yaml"
    variants, invalid = plan(load_study(example))
    assert len(variants) >= 12 and not invalid
    assert len({v.params for v in variants}) == 6  # width x depth
