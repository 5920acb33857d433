"""Hostile checkpoints, on every command that reads one: ``eval``, ``generate``, ``export-hf``,
``train --resume`` (and a run folder's own ``last.ckpt``), ``classification.init_from`` and the
load Lightning does when a run resumes. Each file is refused with exit status 1 and one line that
names it; none prints a traceback, runs code from a pickle or suggests ``weights_only=False``;
nothing loads weights that are damaged or do not fit their spec; a refused resume leaves the run's
own checkpoints as they were, and the run then resumes from them.

The damage tests of a file's bytes (empty, truncated, garbage, a flipped bit) against the
checksums, and the fallback to ``last-1.ckpt``, are in ``tests/test_checkpoints.py``; signals,
full disks and file-size limits in ``tests/test_training_faults.py``; locks and unwritable folders
in ``tests/test_run_folder.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from hostile_helpers import cli, lm_checkpoint, refused
from recipe_helpers import one_error_line, tiny_recipe

MARKER = "pwned-by-a-checkpoint"


class _RunsCode:
    """What a malicious pickle holds: unpickling it would create the marker file."""

    def __init__(self, folder: Path):
        self.target = str(folder / MARKER)

    def __reduce__(self):
        return (open, (self.target, "w"))


def _reseal(checkpoint: dict, path: Path) -> Path:
    """``checkpoint`` saved with checksums that match it: a file that is whole, whatever it holds."""
    from yamlformer.builder.checkpoints import seal

    torch.save(seal(checkpoint), path)
    return path


#: hostile files: name -> (how to write it from a good checkpoint into a folder, words the refusal holds)
def _write(kind: str, good: Path, folder: Path) -> Path:
    path = folder / f"{kind}.ckpt"
    data = good.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    elif kind == "bit-flipped":
        at = len(data) // 2
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :])
    elif kind == "garbled directory":  # a changed byte in the zip's table of contents: a name not UTF-8
        at = data.rindex(b"data.pkl")
        path.write_bytes(data[:at] + bytes([0xCE]) + data[at + 1 :])
    elif kind == "unsafe pickle":
        torch.save({"state_dict": {}, "builder": _RunsCode(folder)}, path)
    elif kind == "unsafe legacy pickle":  # torch's format before zip archives
        torch.save({"builder": _RunsCode(folder)}, path, _use_new_zipfile_serialization=False)
    elif kind == "plain pickle":
        with open(path, "wb") as f:
            pickle.dump({"builder": _RunsCode(folder)}, f)
    elif kind == "foreign state dict":
        torch.save(torch.nn.Linear(4, 4).state_dict(), path)
    elif kind == "foreign lightning":  # a Lightning checkpoint of another project
        torch.save(
            {
                "epoch": 3,
                "global_step": 100,
                "pytorch-lightning_version": "2.1.0",
                "state_dict": {"layer.weight": torch.ones(2, 2)},
                "loops": {},
                "callbacks": {},
                "optimizer_states": [],
                "lr_schedulers": [],
                "hyper_parameters": {"lr": 0.1},
            },
            path,
        )
    elif kind == "not a mapping":
        torch.save([torch.ones(2)], path)
    elif kind == "folder":
        path.mkdir()
    return path


EXPECTED = {
    "empty": "is damaged: it is empty",
    "truncated": "is damaged",
    "garbage": "is damaged",
    "bit-flipped": "is damaged",
    "garbled directory": "is damaged: its table of contents is garbled",
    "unsafe pickle": "is not a checkpoint this tool can load safely",
    "unsafe legacy pickle": "is not a checkpoint this tool can load safely",
    "plain pickle": "is not a checkpoint this tool can load safely",
    "foreign state dict": "was not written by `builder train`",
    "foreign lightning": "a Lightning checkpoint of another program",
    "not a mapping": "is not a `builder train` checkpoint",
    "folder": "folder",
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return lm_checkpoint(tmp_path_factory.mktemp("good"))


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_command_that_reads_a_checkpoint_refuses_a_hostile_one_in_one_line(good, tmp_path, capsys, kind):
    bad = _write(kind, good, tmp_path)
    out, weights = tmp_path / "hf", tmp_path / "model.safetensors"
    for argv in (
        ["eval", bad, "--max-batches", "1"],
        ["generate", bad, "--prompt", "ab", "--max-new-tokens", "2"],
        ["export-hf", bad, "-o", out],
        ["consolidate", bad, "-o", weights],
    ):
        result = cli(capsys, *argv)
        needle = "is not a model folder" if kind == "folder" and argv[0] == "generate" else EXPECTED[kind]
        refused(result, 1, str(bad), needle)
    assert not (tmp_path / MARKER).exists()  # no pickle ran code
    assert not out.exists() and not weights.exists()  # nothing half-written


def test_a_pickle_that_runs_code_is_never_unpickled_by_the_resume_load(good, tmp_path):
    """Lightning reads the checkpoint a run resumes from through our checkpoint IO: weights only."""
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.checkpointing import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    assert io.load_checkpoint(good)["global_step"] == 0
    for kind in ("unsafe pickle", "unsafe legacy pickle", "plain pickle"):
        with pytest.raises(RecipeError, match="not a checkpoint this tool can load safely"):
            io.load_checkpoint(_write(kind, good, tmp_path))
    assert not (tmp_path / MARKER).exists()


def test_a_legacy_format_checkpoint_of_plain_tensors_loads(good, tmp_path, capsys):
    """torch's pickle format before zip archives is read as safely as a zip; only ours is accepted."""
    from yamlformer.builder.checkpoints import read_checkpoint

    checkpoint = torch.load(good, weights_only=True)
    legacy = tmp_path / "legacy.pt"
    torch.save(checkpoint, legacy, _use_new_zipfile_serialization=False)
    assert read_checkpoint(legacy)["global_step"] == 0
    result = cli(capsys, "generate", legacy, "--prompt", "ab", "--max-new-tokens", "2")
    assert result.status == 0 and result.out.startswith("ab") and "Traceback" not in result.err, result.text


def test_weights_that_do_not_fit_their_spec_are_named_not_loaded(good, tmp_path, capsys):
    checkpoint = torch.load(good, weights_only=True)
    name = "model.decoder.layers.0.attention.q_proj.weight"
    wrong = dict(checkpoint, state_dict={**checkpoint["state_dict"], name: torch.ones(3, 3)})
    lacking = dict(checkpoint, state_dict={k: v for k, v in checkpoint["state_dict"].items() if k != name})
    for path, words in (
        (_reseal(wrong, tmp_path / "wrong.ckpt"), ("has shape [3, 3]", "[32, 32]")),
        (_reseal(lacking, tmp_path / "lacking.ckpt"), ("decoder.layers.0.attention.q_proj.weight",)),
    ):
        for argv in (
            ["eval", path, "--max-batches", "1"],
            ["generate", path, "--prompt", "ab"],
            ["consolidate", path, "-o", tmp_path / "w.safetensors"],
        ):
            refused(cli(capsys, *argv), 1, str(path), "its weights do not fit its model spec", *words)
        refused(cli(capsys, "export-hf", path, "-o", tmp_path / "hf"), 1, *words)
    assert not (tmp_path / "hf").exists()


def test_a_tokenizer_or_recipe_record_that_cannot_be_used_is_named(good, tmp_path, capsys):
    checkpoint = torch.load(good, weights_only=True)
    odd = _reseal(
        dict(checkpoint, builder={**checkpoint["builder"], "tokenizer": {"type": "mystery"}}),
        tmp_path / "tokenizer.ckpt",
    )
    for argv in (["eval", odd, "--max-batches", "1"], ["generate", odd, "--prompt", "ab"]):
        refused(cli(capsys, *argv), 1, str(odd), "its tokenizer cannot be rebuilt", "mystery")
    refused(cli(capsys, "export-hf", odd, "-o", tmp_path / "hf"), 1, str(odd), "tokenizer")
    meta = {k: v for k, v in checkpoint["builder"].items() if k != "recipe"}
    no_recipe = _reseal(dict(checkpoint, builder=meta), tmp_path / "recipe.ckpt")
    refused(cli(capsys, "eval", no_recipe, "--max-batches", "1"), 1, str(no_recipe), "holds no training recipe")


def test_an_unreadable_checkpoint_is_named(good, tmp_path, capsys, monkeypatch):
    import yamlformer.builder.checkpoints.read

    locked = tmp_path / "locked.ckpt"
    shutil.copy(good, locked)

    def no_permission(path, *args, **kwargs):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(yamlformer.builder.checkpoints.read, "open", no_permission, raising=False)
    for argv in (
        ["eval", locked],
        ["generate", locked, "--prompt", "ab"],
        ["export-hf", locked, "-o", tmp_path / "hf"],
    ):
        refused(cli(capsys, *argv), 1, f"cannot read {locked}: Permission denied")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads a file of mode 000")
def test_a_file_without_read_permission_is_named(good, tmp_path, capsys):
    locked = tmp_path / "locked.ckpt"
    shutil.copy(good, locked)
    locked.chmod(0)
    refused(cli(capsys, "eval", locked), 1, str(locked), "Permission denied")


def test_export_hf_knows_a_checkpoint_by_its_bytes_not_its_name(good, tmp_path, capsys):
    renamed = tmp_path / "model.bin"
    shutil.copy(good, renamed)
    result = cli(capsys, "export-hf", renamed, "-o", tmp_path / "hf")
    assert result.status == 0, result.text
    assert (tmp_path / "hf" / "config.json").is_file()
    pickled = _write("plain pickle", good, tmp_path).rename(tmp_path / "weights.pkl")
    refused(cli(capsys, "export-hf", pickled, "-o", tmp_path / "hf2"), 1, str(pickled), "can load safely")
    assert not (tmp_path / MARKER).exists()


def _copy_run(summary: dict, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(summary["output_dir"], run)
    (run / "run.lock").unlink(missing_ok=True)
    return run


@pytest.mark.parametrize("kind", ["foreign lightning", "foreign state dict", "unsafe pickle", "plain pickle"])
def test_train_resume_refuses_another_programs_checkpoint_and_keeps_its_own(unbroken_run, tmp_path, capsys, kind):
    from yamlformer.builder.cli import main

    recipe, summary = unbroken_run
    run = _copy_run(summary, tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    bad = _write(kind, Path(summary["last"]), tmp_path)
    assert main(["train", str(recipe), "--no-samples", "--set", f"trainer.output_dir={run}", "--resume", str(bad)]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert str(bad) in line and EXPECTED[kind] in line, line
    assert "weights_only" not in line and not (tmp_path / MARKER).exists()
    assert last.read_bytes() == before  # the run's own checkpoint is untouched
    assert main(["train", str(recipe), "--no-samples", "--set", f"trainer.output_dir={run}"]) == 0  # and resumes
    assert f"resuming from {last}" in capsys.readouterr().out


def test_a_run_folder_holding_another_programs_checkpoint_is_not_resumed(tmp_path, capsys):
    from yamlformer.builder.cli import main

    recipe = tiny_recipe(tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    foreign = _write("foreign lightning", Path(__file__), tmp_path)
    last.parent.mkdir(parents=True)
    shutil.copy(foreign, last)
    assert main(["train", str(recipe), "--no-samples"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith(f"builder train: {last} was not written by `builder train`"), line
    assert "a Lightning checkpoint of another program" in line and "--fresh" in line
    kept = last.with_name("last.ckpt.damaged")  # set aside, whole, so no later save keeps it as last-1
    assert kept.read_bytes() == foreign.read_bytes() and kept.name in line


def _classify_recipe(tmp_path: Path, init_from: Path) -> Path:
    from test_encoder_recipes import _write_recipe

    (tmp_path / "train.jsonl").write_text(
        "".join(f'{{"text": "word {i}", "label": "{"ab"[i % 2]}"}}\n' for i in range(20)), encoding="utf-8"
    )
    return _write_recipe(
        tmp_path,
        "classify",
        {
            "task": "classification",
            "data": {"file": "train.jsonl", "cache_dir": str(tmp_path / "cache")},
            "classification": {"init_from": str(init_from)},
            "trainer": {"max_steps": 2},
        },
    )


@pytest.mark.parametrize("kind", ["unsafe pickle", "truncated", "foreign lightning", "folder"])
def test_classification_init_from_names_the_field_and_the_file(good, tmp_path, capsys, kind):
    from yamlformer.builder.cli import main

    bad = _write(kind, good, tmp_path)
    assert main(["train", str(_classify_recipe(tmp_path, bad)), "--no-samples"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith("builder train: classification.init_from") and str(bad) in line, line
    assert "weights_only" not in line and not (tmp_path / MARKER).exists()
    assert not (tmp_path / "classify" / "checkpoints").exists()


def test_classification_init_from_an_lm_checkpoint_says_which_task_it_has(good, tmp_path, capsys):
    from yamlformer.builder.cli import main

    assert main(["train", str(_classify_recipe(tmp_path, good)), "--no-samples"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert str(good) in line and "trained for task 'lm', not mlm" in line, line


def _full_disk_after(monkeypatch, nbytes: int) -> None:
    """safetensors writes ``nbytes`` of a file, then the disk is full (as its Rust writer reports it)."""
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * nbytes)
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def test_a_full_disk_during_export_or_consolidate_leaves_no_partial_file(good, tmp_path, capsys, monkeypatch):
    out, weights = tmp_path / "hf", tmp_path / "model.safetensors"
    weights.write_bytes(b"an earlier consolidation")
    with monkeypatch.context() as patch:
        _full_disk_after(patch, 1000)
        refused(
            cli(capsys, "export-hf", good, "-o", out),
            1,
            f"cannot write {out / 'model.safetensors'}",
            "no space left on the device",
        )
        refused(
            cli(capsys, "consolidate", good, "-o", weights, "--overwrite"),
            1,
            f"cannot write {weights}",
            "no space left on the device",
        )
    assert sorted(p.name for p in out.iterdir()) == []  # no partial model.safetensors, no temp file
    assert weights.read_bytes() == b"an earlier consolidation"  # the earlier file is kept whole
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    assert cli(capsys, "export-hf", good, "-o", out).status == 0  # the rerun on a disk with room
    assert cli(capsys, "consolidate", good, "-o", weights, "--overwrite").status == 0
    from safetensors.torch import load_file

    assert "decoder.layers.0.attention.q_proj.weight" in load_file(str(weights))


def _printable_corpus(folder: Path) -> Path:
    """Text in the characters the ``good`` checkpoint's tokenizer knows (printable ASCII)."""
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    return corpus


def test_model_init_from_is_read_once_and_a_flipped_bit_in_it_is_refused_in_one_line(
    good, tmp_path, capsys, monkeypatch
):
    """The spec, the tokenizer and the weights a run takes from ``model.init_from`` come from one
    load and one verification of the file; a bit flipped in its tensors (which ``torch.load``
    alone reads without a word) stops the run before any work, in one line naming the field."""
    from test_checkpoints import _flip_a_tensor_bit, reads_until_training

    from yamlformer.builder.cli import main

    data = {"sources": [str(_printable_corpus(tmp_path))], "max_bytes": None, "cache_dir": str(tmp_path / "cache")}
    trainer = {"max_steps": 2, "val_check_interval": 100, "limit_val_batches": 1}
    for name in ("whole", "flipped"):
        (tmp_path / name).mkdir()
    source = shutil.copy(good, tmp_path / "pretrained.ckpt")  # a file this process has not read yet
    reads = reads_until_training(monkeypatch)
    recipe = tiny_recipe(tmp_path / "whole", model={"spec": None, "init_from": str(source)}, data=data, trainer=trainer)
    assert main(["train", str(recipe), "--no-samples"]) == 0
    assert "weights: " in capsys.readouterr().out
    source = str(Path(source).resolve())
    assert reads[("load", source)] == 1 and reads[("verify", source)] == 1, dict(reads)

    bad = tmp_path / "flipped.ckpt"
    bad.write_bytes(_flip_a_tensor_bit(good.read_bytes()))
    recipe = tiny_recipe(tmp_path / "flipped", model={"spec": None, "init_from": str(bad)}, data=data, trainer=trainer)
    assert main(["train", str(recipe), "--no-samples"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith(f"builder train: model.init_from: {bad} is damaged: tensor "), line
    assert "does not match its checksum" in line, line
    assert not (tmp_path / "flipped" / "run" / "checkpoints").exists()
