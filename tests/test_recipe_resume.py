"""Scale-out and fault tolerance: SIGKILL then resume equals an unbroken run; 2-process DDP equals one."""

from __future__ import annotations

import csv
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from recipe_helpers import builder_process, history, tiny_recipe


def _step(checkpoint) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.slow  # 15 s; SIGTERM and Ctrl-C resumes to an unbroken run's losses: tests/test_training_faults.py
def test_killed_run_resumes_to_the_same_losses(tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    steps = 60
    killed_dir, unbroken_dir = tmp_path / "killed", tmp_path / "unbroken"
    for d in (killed_dir, unbroken_dir):
        d.mkdir()
    # losses are read every 4 steps, checkpoints every 5: a resumed run carries the unread ones over
    trainer = {
        "max_steps": steps,
        "checkpoint_every_n_steps": 5,
        "val_check_interval": 20,
        "limit_val_batches": 1,
        "log_every_n_steps": 4,
    }
    killed = tiny_recipe(killed_dir, trainer=dict(trainer, output_dir=str(killed_dir / "run")))
    last = killed_dir / "run" / "checkpoints" / "last.ckpt"

    child = builder_process(
        "train", str(killed), "--no-samples", cwd=killed_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not last.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err.decode()[-2000:]
    at_kill = _step(last)
    assert 0 < at_kill < steps, "the run ended before it could be killed"

    resumed = run(killed, samples=False)  # the same command again: it picks up last.ckpt
    assert resumed["steps"] == steps
    assert f"resuming from {last}" in capsys.readouterr().out
    out = killed_dir / "run"  # one log, continued: every step once
    assert (
        [p.name for p in (out / "logs").iterdir()] == ["version_0"] == [p.name for p in (out / "tensorboard").iterdir()]
    )
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as f:
        logged = [int(row["step"]) for row in csv.DictReader(f) if row["loss"]]
    assert logged == sorted(set(logged)) and logged[-1] == steps - 1

    unbroken = tiny_recipe(unbroken_dir, trainer=dict(trainer, output_dir=str(unbroken_dir / "run")))
    summary = run(unbroken, samples=False)
    a, b = history(last), history(summary["last"])
    assert _step(last) == steps and len(a["train"]) == len(b["train"]) == steps // 4
    assert [s for s, _ in a["train"]] == [s for s, _ in b["train"]]
    torch.testing.assert_close(
        torch.tensor([x for _, x in a["train"]]), torch.tensor([x for _, x in b["train"]]), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor([v[1] for v in a["val"]]), torch.tensor([v[1] for v in b["val"]]), rtol=0, atol=1e-6
    )
    weights_a = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    weights_b = torch.load(summary["last"], map_location="cpu", weights_only=True)["state_dict"]
    for name in weights_b:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=0, atol=1e-6)


def test_resume_refuses_a_different_model(tmp_path, capsys):
    from yamlformer.builder.cli import main

    path = tiny_recipe(tmp_path, trainer={"max_steps": 2, "output_dir": str(tmp_path / "run")})
    assert main(["train", str(path), "--no-samples"]) == 0
    assert main(["train", str(path), "--no-samples", "--set", "model.overrides.d_model=48"]) == 1
    assert "model.spec.d_model: 32 in the checkpoint, 48 now" in capsys.readouterr().err
    assert main(["train", str(path), "--no-samples", "--fresh", "--set", "model.overrides.d_model=48"]) == 0


def test_a_resumed_run_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """The recipe comparison, the choice of the newest intact checkpoint, its checks against the
    recipe and Lightning's restore share one load and one verification of ``last.ckpt``."""
    from test_checkpoints import reads_until_training

    from yamlformer.recipes.training.run import run

    trainer = {"max_steps": 2, "checkpoint_every_n_steps": 2, "val_check_interval": 100, "limit_val_batches": 1}
    path = tiny_recipe(tmp_path, trainer=trainer)
    first = run(path, samples=False)
    reads = reads_until_training(monkeypatch)
    resumed = run(tiny_recipe(tmp_path, trainer=dict(trainer, max_steps=4)), samples=False)
    assert resumed["steps"] == 4
    last = str((tmp_path / "run" / "checkpoints" / "last.ckpt").resolve())
    assert Path(first["last"]).resolve() == Path(last)
    assert reads[("load", last)] == 1 and reads[("verify", last)] == 1, dict(reads)


@pytest.mark.slow  # 16 s; two FSDP processes against one: tests/test_sharded.py (default)
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path):
    from yamlformer.recipes.training.run import run

    trainer = {"max_steps": 8, "val_check_interval": 4, "limit_val_batches": 2, "log_every_n_steps": 1}
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    for d in (ddp_dir, single_dir):
        d.mkdir()
    ddp = tiny_recipe(
        ddp_dir,
        data={"batch_size": 2},
        trainer=dict(trainer, devices=2, strategy="ddp", output_dir=str(ddp_dir / "run")),
    )
    child = builder_process(
        "train", str(ddp), "--no-samples", cwd=ddp_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0, out.decode()[-3000:]
    assert "GLOBAL_RANK: 1" in out.decode() or "MEMBER: 2/2" in out.decode()

    single = tiny_recipe(single_dir, data={"batch_size": 4}, trainer=dict(trainer, output_dir=str(single_dir / "run")))
    summary = run(single, samples=False)
    a, b = history(ddp_dir / "run" / "checkpoints" / "last.ckpt"), history(summary["last"])
    assert len(a["train"]) == len(b["train"]) == 8
    torch.testing.assert_close(
        torch.tensor([x for _, x in a["train"]]), torch.tensor([x for _, x in b["train"]]), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor([v[1] for v in a["val"]]), torch.tensor([v[1] for v in b["val"]]), rtol=0, atol=1e-5
    )


def test_a_time_limit_is_per_invocation_and_every_stop_names_its_cause(tmp_path, capsys):
    """``trainer.max_time`` bounds each invocation: the same command again resumes and trains for
    another max_time (it used to count the time already spent, train 0 steps and exit 0); the last
    lines say which limit ended the run and how to go on."""
    from yamlformer.recipes.training.run import run

    path = tiny_recipe(
        tmp_path,
        trainer={
            "max_steps": 1_000_000,
            "max_time": 2,
            "val_check_interval": 1_000_000,
            "checkpoint_every_n_steps": 1_000_000,
        },
    )
    first = run(path, samples=False)
    out = capsys.readouterr().out
    assert 0 < first["steps"] < 1_000_000
    assert (
        f"stopped: trainer.max_time 2 (per invocation) reached at step {first['steps']:,} of 1,000,000; run the "
        f"same command again to go on from step {first['steps']:,}"
    ) in out
    second = run(path, samples=False)
    assert second["steps"] > first["steps"]  # it trained for another 2 s
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().out
    done = run(path, {"trainer.max_steps": second["steps"] + 2}, samples=False)
    assert done["steps"] == second["steps"] + 2
    assert f"stopped: trainer.max_steps {second['steps'] + 2:,} reached" in capsys.readouterr().out
    again = run(path, {"trainer.max_steps": second["steps"] + 2}, samples=False)
    assert again["steps"] == done["steps"]
    assert (
        f"nothing to train: the checkpoint is at step {done['steps']:,}, trainer.max_steps {done['steps']:,}; "
        "raise trainer.max_steps"
    ) in capsys.readouterr().out
