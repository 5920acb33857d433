"""Weights & Biases in offline mode, with no network: a run is read back from its own run files by
the ``wandb`` package's reader (``wandb leet inspect --json``, which decodes the ``.wandb``
transaction log): the resolved recipe and the estimate as its config, each metric's history at the
steps it was logged; a resumed run writes into the same run id; ``wandb sync`` finds the run to
upload later (asked with ``--dry-run`` against a closed port, so nothing leaves the machine)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import tiny_recipe

pytest.importorskip("wandb", reason="wandb is not installed (pip install 'yamlformer[wandb]')")

TRAINER = {"max_steps": 8, "val_check_interval": 4, "checkpoint_every_n_steps": 4, "limit_val_batches": 2}


def _closed_port() -> str:
    """A loopback address nothing listens on: a W&B client that tried the network would fail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def no_network(monkeypatch):
    url = _closed_port()
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return {**{k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}, "WANDB_BASE_URL": url}


def records(log: Path) -> list[dict]:
    """The records of a run's ``.wandb`` log, as the wandb package decodes them."""
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def run_logs(out: Path) -> list[Path]:
    """The ``.wandb`` logs under a run folder, oldest first (one per invocation)."""
    return sorted((out / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def history(found: list[dict], key: str) -> list[tuple[int, float]]:
    """``(trainer step, value)`` of each history row that has ``key``."""
    rows = [r["history"]["item"] for r in found if r["type"] == "history"]
    return [(int(row["trainer/global_step"]), float(row[key])) for row in rows if key in row]


def config(found: list[dict]) -> dict:
    merged: dict = {}
    for r in found:
        if r["type"] == "config":
            merged.update(r["config"].get("update", {}))
    return merged


def test_an_offline_run_is_read_back_from_its_files_and_resumes_into_the_same_run(tmp_path, no_network):
    from yamlformer.recipes.training.run import run

    loggers = {"wandb": {"offline": True, "project": "tiny-test", "tags": {"team": "x"}}}
    path = tiny_recipe(tmp_path, trainer=dict(TRAINER, log_every_n_steps=2, loggers=loggers))
    out = tmp_path / "run"
    run(path, samples=False)
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
    [first] = run_logs(out)
    assert first.name == f"run-{run_id}.wandb"
    found = records(first)
    [started] = [r["run"] for r in found if r["type"] == "run"]
    assert started["run_id"] == run_id and started["project"] == "tiny-test" and "team:x" in started["tags"]
    params = config(found)
    assert params["trainer.max_steps"] == 8 and params["model.spec.d_model"] == 32
    assert params["estimate.params_total"] > 0 and params["estimate.train_flops_per_token"] > 0
    assert [step for step, _ in history(found, "loss")] == [1, 3, 5, 7]  # every 2 steps, as the CSV
    assert [step for step, _ in history(found, "val_loss")] == [3, 7]
    assert all(rate > 0 for _, rate in history(found, "tok/s"))

    run(path, {"trainer.max_steps": 12}, samples=False)  # resumed: the same W&B run goes on
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == run_id
    first_log, second = run_logs(out)
    assert second.name == f"run-{run_id}.wandb" and second != first_log
    again = records(second)
    assert [r["run"]["run_id"] for r in again if r["type"] == "run"] == [run_id]
    assert [step for step, _ in history(again, "loss")] == [9, 11]

    # `wandb sync` is how the offline run reaches a server later: it finds both invocations' logs
    listed = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run"],
        cwd=out,
        env=no_network,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-500:]
    assert "Would sync 2 run(s)" in listed.stdout + listed.stderr, listed.stdout + listed.stderr

    run(path, {"trainer.max_steps": 2}, fresh=True, samples=False)  # starting over: a new W&B run
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] != run_id
