"""A run logs where teams look: a real MLflow tracking server (sqlite store, local artifacts) that
a fixture starts on a loopback port reads back the resolved recipe and the estimate as params and
each metric with its steps; a resumed run writes into the same MLflow run, --fresh into a new
one; TensorBoard's own reader finds the same metrics; a bad logger option is one located line."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
from recipe_helpers import tiny_recipe

from yamlformer.recipes.optim.schedule import lr_multiplier
from yamlformer.recipes.tasks import load_recipe

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'yamlformer[mlflow]')")

TRAINER = {"max_steps": 8, "val_check_interval": 4, "checkpoint_every_n_steps": 4, "limit_val_batches": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:``port`` with its store under ``root``; waits at most 60 s."""
    root.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--workers",
            "1",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "wb"),  # noqa: SIM115 - the server's whole life
        start_new_session=True,  # its own process group: the server's workers die with it (kill_server)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job runner and its 7 consumers
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.skip(f"mlflow server exited at start: {(root / 'server.log').read_text()[-300:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.2)
    stop_server(server)
    pytest.skip("mlflow server did not listen within 60 s")


def kill_server(server: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the server and its workers (its process group), as a host that dies takes them all."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, sig)


def stop_server(server: subprocess.Popen) -> None:
    """The server and every process it started: none outlives the test."""
    kill_server(server, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(10)
    kill_server(server)  # what ignored SIGTERM
    server.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    port = _free_port()
    server = start_server(tmp_path_factory.mktemp("mlflow"), port)
    yield f"http://127.0.0.1:{port}"
    stop_server(server)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_a_run_is_read_back_from_the_mlflow_server_and_resumes_into_the_same_run(tmp_path, mlflow_server):
    from yamlformer.recipes.training.run import run

    loggers = {"mlflow": {"tracking_uri": mlflow_server, "experiment": "tiny-test", "tags": {"team": "x"}}}
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, log_every_n_steps=2, loggers=loggers))
    out = tmp_path / "run"
    run(path, samples=False)
    ids = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = mlflow.MlflowClient(mlflow_server)
    tracked = client.get_run(ids["run_id"])
    params = tracked.data.params
    assert params["trainer.max_steps"] == "8" and params["model.spec.d_model"] == "32"
    assert int(params["estimate.params_total"]) > 0 and int(params["estimate.train_flops_per_token"]) > 0
    assert int(params["estimate.memory_per_rank_bytes"]) > 0
    assert tracked.data.tags["team"] == "x" and tracked.info.status == "FINISHED"
    loss = _history(client, ids["run_id"], "loss")
    assert [step for step, _ in loss] == [1, 3, 5, 7]  # the row of the batch just trained, every 2 steps
    assert [step for step, _ in _history(client, ids["run_id"], "val_loss")] == [3, 7]
    assert _history(client, ids["run_id"], "tok/s")
    # the learning rate each logged step applied, as the recipe's schedule gives it for that step
    recipe = load_recipe(path).recipe
    lr = recipe.optimizer.peak_lr
    logged = _history(client, ids["run_id"], "lr")
    assert [s for s, _ in logged] == [1, 3, 5, 7]
    assert [v for _, v in logged] == pytest.approx([lr * lr_multiplier(s, recipe.schedule, lr, 8) for s, _ in logged])
    memory = _history(client, ids["run_id"], "process_peak_rss_gib")  # a CPU run: the process's peak RSS
    assert [s for s, _ in memory] == [1, 3, 5, 7] and all(0.01 < gib < 1000 for _, gib in memory)
    assert not client.list_artifacts(ids["run_id"], "checkpoints")  # not uploaded unless log_model

    run(path, {"trainer.max_steps": 12}, samples=False)  # resumed: the same tracked run goes on
    again = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert again["run_id"] == ids["run_id"]
    assert [step for step, _ in _history(client, ids["run_id"], "loss")] == [1, 3, 5, 7, 9, 11]
    resumed = client.get_run(ids["run_id"]).data
    assert resumed.params["trainer.max_steps"] == "8" and resumed.tags["resumed.trainer.max_steps"] == "12"

    run(path, {"trainer.max_steps": 4}, fresh=True, samples=False)  # starting over: a new tracked run
    fresh = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert fresh["run_id"] != ids["run_id"]
    assert [step for step, _ in _history(client, fresh["run_id"], "loss")] == [1, 3]


def test_log_model_uploads_the_last_and_best_checkpoints_as_artifacts(tmp_path, mlflow_server):
    from yamlformer.recipes.training.run import run

    loggers = {"mlflow": {"tracking_uri": mlflow_server, "experiment": "tiny-models", "log_model": True}}
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, max_steps=4, loggers=loggers))
    run(path, samples=False)
    run_id = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["run_id"]
    client = mlflow.MlflowClient(mlflow_server)
    uploaded = {Path(a.path).name: a.file_size for a in client.list_artifacts(run_id, "checkpoints")}
    local = tmp_path / "run" / "checkpoints"
    assert uploaded == {name: (local / name).stat().st_size for name in ("last.ckpt", "best.ckpt")}
    fetched = Path(client.download_artifacts(run_id, "checkpoints/last.ckpt", str(tmp_path / "fetched")))
    assert fetched.read_bytes() == (local / "last.ckpt").read_bytes()


def test_tensorboard_reads_the_same_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from yamlformer.recipes.training.run import run

    run(tiny_recipe(tmp_path, trainer=dict(TRAINER, log_every_n_steps=2)), samples=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "version_0"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 3, 5, 7]
    assert [e.step for e in events.Scalars("val_loss")] == [3, 7]


def test_a_logger_left_off_writes_nothing_and_a_bad_option_is_one_located_line(tmp_path, capsys):
    from yamlformer.builder.cli import main
    from yamlformer.recipes.training.run import run

    run(tiny_recipe(tmp_path, trainer=dict(TRAINER, max_steps=2, loggers={"tensorboard": False})), samples=False)
    assert not (tmp_path / "run" / "tensorboard").exists() and (tmp_path / "run" / "logs" / "version_0").is_dir()

    for bad, field in (({"comet": {}}, "comet"), ({"mlflow": {"projet": "x"}}, "mlflow.projet")):
        path = tiny_recipe(tmp_path, trainer=dict(TRAINER, loggers=bad))
        assert main(["train", str(path), "--dry-run"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and f"trainer.loggers.{field}" in err[0], err


def test_a_missing_client_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from yamlformer.builder.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, max_steps=2, loggers={"wandb": {"offline": True}}))
    assert main(["train", str(path), "--no-samples"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("wandb:"))
    extra = "pip install 'yamlformer[wandb]'"
    assert len(err) == 1 and err[0].startswith(f"{path}:{line}:"), err
    assert err[0].endswith(f": trainer.loggers.wandb: the wandb package is not installed: {extra}"), err
    assert not (tmp_path / "run").exists()  # refused before any work: no run folder, no corpus


class _KillServer(L.Callback):
    """Kills the MLflow server (SIGKILL, as a crashed host) once ``step`` is trained, and keeps the
    wall time at the end of every training batch."""

    def __init__(self, server: subprocess.Popen, step: int):
        self.server, self.step, self.ends = server, step, []

    def on_train_batch_end(self, trainer, *args):
        self.ends.append((trainer.global_step, time.perf_counter()))
        if trainer.global_step == self.step and self.server.poll() is None:
            kill_server(self.server)
            self.server.wait()


def _csv_steps(out: Path, key: str) -> list[int]:
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(key)]


def _tracker_warnings(text: str) -> list[str]:
    """The tracker's warning lines (the progress bar's redraws end in a carriage return, not a newline)."""
    return [line for line in re.split(r"[\r\n]", text) if line.startswith("warning: mlflow")]


def test_a_server_killed_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, capsys, caplog, monkeypatch):
    from yamlformer.recipes.training.run import run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "3")  # a request to the dead server: 9 s of retries

    port = _free_port()
    server = start_server(tmp_path / "mlflow", port)
    loggers = {"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}}
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, max_steps=16, log_every_n_steps=2, loggers=loggers))
    killer = _KillServer(server, step=6)
    try:
        started = time.perf_counter()
        summary = run(path, samples=False, callbacks=[killer])
        took = time.perf_counter() - started
    finally:
        stop_server(server)
    assert summary["steps"] == 16 and server.returncode is not None
    printed = capsys.readouterr()
    [warning] = _tracker_warnings(printed.out)
    assert "the run goes on without it" in warning and "Traceback" not in printed.out + printed.err
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # urllib3's, one per retry
    # no training step waited for the dead server: MLflow's retries (3 s, then 6 s) ran on the tracker's thread
    after = [t for step, t in killer.ends if step >= 6]
    assert max(b - a for a, b in zip(after, after[1:])) < 4.5, killer.ends
    assert took < 60
    out = tmp_path / "run"
    assert _csv_steps(out, "loss") == list(range(1, 16, 2))  # the CSV kept every row
    assert _csv_steps(out, "val_loss") == [3, 7, 11, 15]


def test_a_server_down_from_the_start_is_one_warning_and_the_run_goes_on(tmp_path, capsys, caplog):
    from yamlformer.recipes.training.run import run
    from yamlformer.recipes.training.trackers import stored_ids

    loggers = {"mlflow": {"tracking_uri": f"http://127.0.0.1:{_free_port()}"}}  # nothing listens there
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, log_every_n_steps=2, loggers=loggers))
    started = time.perf_counter()
    assert run(path, samples=False)["steps"] == 8
    assert time.perf_counter() - started < 60
    printed = capsys.readouterr()
    [warning] = _tracker_warnings(printed.out)
    assert "the run goes on without it" in warning and "Traceback" not in printed.out + printed.err
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # urllib3's, one per retry
    assert _csv_steps(tmp_path / "run", "loss") == [1, 3, 5, 7]
    assert "mlflow" not in stored_ids(tmp_path / "run")  # no tracked run to resume into
