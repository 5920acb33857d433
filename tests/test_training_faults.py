"""Faults during training lose nothing: a signal saves a checkpoint at a step boundary and exits
128 + its number; a full disk or a file-size limit stops the run in one line, keeps the previous
checkpoint and leaves no temp file; each run then resumes to the losses of an unbroken run."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import yaml
from recipe_helpers import REPO, assert_same_run, builder_process, fault_recipe, one_error_line


class SignalAt(L.Callback):
    """Sends this process ``signums`` once, when training reaches ``step`` (as a scheduler would)."""

    def __init__(self, step: int, *signums: int):
        self.step, self.signums, self.sent = step, signums, False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            for signum in self.signums:
                os.kill(os.getpid(), signum)


def send_at(monkeypatch, step: int, *signums: int) -> None:
    """Every Trainer the recipes make gets :class:`SignalAt` first in its callbacks."""
    import yamlformer.recipes.training.run

    make = yamlformer.recipes.training.run.make_trainer

    def make_trainer(*args, **kwargs):
        trainer = make(*args, **kwargs)
        trainer.callbacks.insert(0, SignalAt(step, *signums))
        return trainer

    monkeypatch.setattr(yamlformer.recipes.training.run, "make_trainer", make_trainer)


def _step(path: Path) -> int:
    from yamlformer.builder.checkpoints import read_checkpoint

    return read_checkpoint(path)["global_step"]  # verified: the checkpoint is whole


CHILD = """
import signal, sys
sys.path.insert(0, {tests!r})
import pytest
from test_training_faults import send_at
from yamlformer.builder.cli import main
patch = pytest.MonkeyPatch()
send_at(patch, 5, signal.SIGTERM)
sys.exit(main(["train", {recipe!r}, "--no-samples"]))
"""


def test_sigterm_saves_at_the_step_boundary_exits_143_and_resumes_like_an_unbroken_run(unbroken_run, tmp_path):
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path)
    env = dict(os.environ)
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(tests=str(REPO / "tests"), recipe=str(recipe))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert child.returncode == 143, child.stderr[-3000:]
    line = one_error_line(child.stderr, "builder train:")
    assert line == f"builder train: stopped by SIGTERM at step 5; saved {last}; run the same command to resume"
    assert _step(last) == 5
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert_same_run(last, Path(unbroken_run[1]["last"]))


GROUP_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import lightning as L
import yamlformer.recipes.training.run
from yamlformer.builder.cli import main

class CtrlC(L.Callback):  # a terminal's Ctrl+C: SIGINT to the whole process group, the loader's worker too
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 5:
            os.killpg(os.getpgrp(), signal.SIGINT)

make = yamlformer.recipes.training.run.make_trainer
def make_trainer(*args, **kwargs):
    trainer = make(*args, **kwargs)
    trainer.callbacks.insert(0, CtrlC())
    return trainer
yamlformer.recipes.training.run.make_trainer = make_trainer
sys.exit(main(["train", {recipe!r}, "--no-samples"]))
"""


def test_ctrl_c_to_the_process_group_saves_and_stops_though_the_loader_worker_gets_it_too(tmp_path):
    recipe = fault_recipe(tmp_path)
    data = yaml.safe_load(recipe.read_text())
    data["data"]["num_workers"] = 1  # a batch-making worker in the group
    recipe.write_text(yaml.safe_dump(data))
    env = dict(os.environ)
    child = subprocess.run(
        [sys.executable, "-c", GROUP_CHILD.format(tests=str(REPO / "tests"), recipe=str(recipe))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert child.returncode == 130, child.stderr[-3000:]
    line = one_error_line(child.stderr, "builder train:")
    assert line == f"builder train: stopped by SIGINT at step 5; saved {last}; run the same command to resume"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_sigint_and_slurms_sigusr1_save_and_exit_128_plus_the_signal(tmp_path, capsys, monkeypatch, signum):
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path, max_steps=4)
    send_at(monkeypatch, 3, signum)
    assert main(["train", str(recipe), "--no-samples"]) == 128 + signum
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith(f"builder train: stopped by {signal.Signals(signum).name} at step 3; saved {last}")
    assert _step(last) == 3 and signal.getsignal(signum) is not None  # handlers are given back


def test_a_second_signal_stops_at_once_keeping_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path)
    send_at(monkeypatch, 6, signal.SIGINT, signal.SIGINT)  # Ctrl+C twice: do not wait for the save
    assert main(["train", str(recipe), "--no-samples"]) == 130
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert "stopped by SIGINT again before the step ended" in line and "last checkpoint written is kept" in line
    assert _step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 4


class SignalInValidation(L.Callback):
    """Sends this process ``signum`` once, during the validation at ``step``."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum, self.sent = step, signum, False

    def on_validation_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow
def test_a_signal_during_validation_saves_at_the_next_step_and_resumes_like_an_unbroken_run(
    unbroken_run, tmp_path, capsys, monkeypatch
):
    import yamlformer.recipes.training.run
    from yamlformer.builder.cli import main

    make = yamlformer.recipes.training.run.make_trainer

    def make_trainer(*args, **kwargs):
        trainer = make(*args, **kwargs)
        trainer.callbacks.insert(0, SignalInValidation(6, signal.SIGTERM))
        return trainer

    monkeypatch.setattr(yamlformer.recipes.training.run, "make_trainer", make_trainer)
    recipe = fault_recipe(tmp_path)
    assert main(["train", str(recipe), "--no-samples"]) == 143
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith(f"builder train: stopped by SIGTERM at step 7; saved {last}"), line
    assert _step(last) == 7  # the validation finished, then the step after it: a boundary
    monkeypatch.setattr(yamlformer.recipes.training.run, "make_trainer", make)
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert_same_run(last, Path(unbroken_run[1]["last"]))


def test_a_signal_before_training_stops_at_once(tmp_path, capsys, monkeypatch):
    import yamlformer.recipes.tasks.lm.training
    from yamlformer.builder.cli import main

    prepare = yamlformer.recipes.tasks.lm.training.prepare  # the LM task's data, tokenizer and spec

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(yamlformer.recipes.tasks.lm.training, "prepare", interrupted)
    assert main(["train", str(fault_recipe(tmp_path)), "--no-samples"]) == 143
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line == "builder train: stopped by SIGTERM before training started; there was nothing to save"
    assert (tmp_path / "run" / "run.lock").read_text() == ""  # the folder is free again


#: ``builder train`` sent ``signum`` by itself as it starts: after the command line is read, before
#: torch and Lightning load (what a SLURM warning meets when it comes as a requeued attempt starts)
STARTING_CHILD = """
import os, sys
import yamlformer.recipes.commands.train as command
from yamlformer.builder.cli import main
real = command._run
def starting(args, stop):
    loaded = [name for name in ("torch", "lightning") if name in sys.modules]
    assert not loaded, f"loaded before the signal: {{loaded}}"
    os.kill(os.getpid(), {signum})
    return real(args, stop)
command._run = starting
sys.exit(main(["train", {recipe!r}, "--no-samples"]))
"""


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_as_train_starts_is_handled_slurms_warning_at_the_first_step(unbroken_run, tmp_path, signum):
    """No signal kills ``builder train`` by default while torch loads: ``SIGTERM`` stops at once in
    one line (nothing to save); ``SIGUSR1`` is kept, and the run saves at its first step boundary,
    exits 138 and resumes to the unbroken run's losses."""
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path)
    child = subprocess.run(
        [sys.executable, "-c", STARTING_CHILD.format(signum=int(signum), recipe=str(recipe))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert child.returncode == 128 + signum, child.stderr[-3000:]
    line = one_error_line(child.stderr, "builder train:")
    if signum == signal.SIGTERM:
        assert line == "builder train: stopped by SIGTERM before training started; there was nothing to save"
        assert not last.exists()
        return
    assert line == (
        f"builder train: stopped by SIGUSR1 at step 1 (received before training started); saved {last}; "
        "run the same command to resume"
    )
    assert _step(last) == 1
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert_same_run(last, Path(unbroken_run[1]["last"]))


def test_a_repeated_warning_and_one_after_training_stop_nothing_at_once(tmp_path, capsys, monkeypatch):
    """A second ``SIGUSR1`` while the step finishes still saves at its end (it asks for the same
    thing); one while the run wraps up after training is let pass, and the run ends well."""
    import yamlformer.recipes.training.run
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path, max_steps=4)
    send_at(monkeypatch, 3, signal.SIGUSR1, signal.SIGUSR1)
    assert main(["train", str(recipe), "--no-samples"]) == 138
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line == f"builder train: stopped by SIGUSR1 at step 3; saved {last}; run the same command to resume"
    monkeypatch.undo()
    wrap_up = yamlformer.recipes.training.run.wrap_up

    def warned(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return wrap_up(*args, **kwargs)

    monkeypatch.setattr(yamlformer.recipes.training.run, "wrap_up", warned)
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert _step(last) == 4 and "stopped by" not in capsys.readouterr().err


def test_a_full_disk_keeps_the_previous_checkpoint_and_the_rerun_resumes(unbroken_run, tmp_path, capsys, monkeypatch):
    import yamlformer.builder.checkpoints.write
    from yamlformer.builder.cli import main

    recipe = fault_recipe(tmp_path)
    opened = []
    write = yamlformer.builder.checkpoints.write._ErrorKeepingFile.write

    def filling(self, data):
        if not getattr(self, "counted", False):  # one per checkpoint file written
            self.counted = True
            opened.append(self)
        if len(opened) >= 4:  # last at 4, last and best at 6; then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    monkeypatch.setattr(yamlformer.builder.checkpoints.write._ErrorKeepingFile, "write", filling)
    assert main(["train", str(recipe), "--no-samples"]) == 1
    folder = tmp_path / "run" / "checkpoints"
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert (
        line == f"builder train: could not write {folder / 'last.ckpt'}: no space left on the device; "
        "the previous last.ckpt is kept"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["best.ckpt", "last-1.ckpt", "last.ckpt"]  # no temp file
    assert _step(folder / "last.ckpt") == 6 and _step(folder / "last-1.ckpt") == 4
    monkeypatch.undo()
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert_same_run(folder / "last.ckpt", Path(unbroken_run[1]["last"]))


def test_a_file_size_limit_stops_in_one_line_and_the_rerun_does_not_trip_on_debris(unbroken_run, tmp_path):
    from yamlformer.builder.cli import main

    cache = Path(unbroken_run[0]).parent / "cache"  # tokens already cached: the first big file is a checkpoint
    recipe = fault_recipe(tmp_path)
    limit = 100_000  # a checkpoint of the tiny model is ~330 kB

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    child = builder_process(
        "train",
        str(recipe),
        "--no-samples",
        "--set",
        f"data.cache_dir={cache}",
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limited,
    )
    _, err = child.communicate(timeout=600)
    folder = tmp_path / "run" / "checkpoints"
    assert child.returncode == 1, err[-3000:]
    line = one_error_line(err, "builder train:")
    assert line == (
        f"builder train: could not write {folder / 'last.ckpt'}: file too large (the file-size limit, "
        "`ulimit -f`); no checkpoint was written"
    )
    assert list(folder.iterdir()) == []
    assert main(["train", str(recipe), "--no-samples", "--set", f"data.cache_dir={cache}"]) == 0
    assert_same_run(folder / "last.ckpt", Path(unbroken_run[1]["last"]))


@pytest.mark.slow
def test_sigterm_from_outside_stops_every_ddp_rank_at_the_same_step(tmp_path):
    """Two CPU processes (Lightning's launcher); SIGTERM to the launcher only: both ranks agree
    on the step, the checkpoint is saved, each exits 143, and the run resumes."""
    recipe = fault_recipe(
        tmp_path, max_steps=400, checkpoint_every_n_steps=2, val_check_interval=200, devices=2, strategy="ddp"
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    child = builder_process(
        "train", str(recipe), "--no-samples", cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not last.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 143, err[-3000:]
    line = one_error_line(err, "builder train:")
    step = int(line.split(" at step ")[1].split(";")[0])
    assert 0 < step < 400 and _step(last) == step
    resumed = builder_process(
        "train",
        str(recipe),
        "--no-samples",
        "--set",
        f"trainer.max_steps={step + 4}",
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert _step(last) == step + 4


def test_a_task_run_stops_on_a_signal_the_same_way(tmp_path, capsys, monkeypatch):
    """The tasks besides LM (here masked-LM pretraining) share the run session and its stop."""
    import yaml

    from yamlformer.builder.cli import main

    encoder = {
        "name": "tiny-encoder",
        "architecture": "encoder-only",
        "d_model": 32,
        "max_seq_len": 32,
        "position": {"type": "learned"},
        "head": {"type": "mlm"},
        "encoder": {"n_layers": 1, "attention": {"n_heads": 2}, "ffn": {"hidden_dim": 64}},
    }
    recipe = tmp_path / "mlm.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "task": "mlm",
                "model": {"spec": encoder},
                "tokenizer": {"vocab_size": 600},
                "data": {
                    "sources": ["python-stdlib"],
                    "max_bytes": 40_000,
                    "seq_len": 32,
                    "batch_size": 4,
                    "cache_dir": str(tmp_path / "cache"),
                },
                "trainer": {
                    "max_steps": 4,
                    "val_check_interval": 4,
                    "limit_val_batches": 1,
                    "accelerator": "cpu",
                    "precision": "32",
                    "devices": 1,
                    "output_dir": str(tmp_path / "run"),
                },
            }
        )
    )
    send_at(monkeypatch, 2, signal.SIGTERM)
    assert main(["train", str(recipe), "--no-samples"]) == 143
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert one_error_line(capsys.readouterr().err, "builder train:").startswith(
        f"builder train: stopped by SIGTERM at step 2; saved {last}"
    )
    monkeypatch.undo()
    assert _step(last) == 2 and main(["train", str(recipe)]) == 0 and _step(last) == 4
