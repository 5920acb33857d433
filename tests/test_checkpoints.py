"""Checkpoints that prove they are whole: damaged files are named in one line by every command
that reads them, a resume falls back to the newest intact checkpoint, and nothing loads damaged
weights silently."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from recipe_helpers import assert_same_run, history, one_error_line


def _flip_a_tensor_bit(data: bytes) -> bytes:
    """One bit flipped in the middle of the largest tensor's bytes (torch's zip format: the entry's
    data follows its local header, whose padding the central directory does not show), so the
    flip lands in values, never in zip padding, whatever the checkpoint's layout."""
    import io
    import struct
    import zipfile

    entries = [i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if "/data/" in i.filename]
    largest = max(entries, key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[largest.header_offset + 26 : largest.header_offset + 30])
    at = largest.header_offset + 30 + name_len + extra_len + largest.file_size // 2
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


#: ways a checkpoint file is found broken: each turns the bytes of a good one into a bad one
DAMAGE = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "garbage": lambda data: bytes(range(256)) * 64,
    "bit-flipped": _flip_a_tensor_bit,
}


def reads_until_training(monkeypatch) -> Counter:
    """What the runs that follow read of each checkpoint (by resolved path) up to their first
    training step (filled in when it starts): ``("load", file)`` a file unpickled, ``("verify",
    file)`` its tensors checked against their checksums, ``("shards", folder)`` a folder's shard
    files checked, ``("dcp", folder)`` its shards read into a model."""
    import lightning as L
    import torch.distributed.checkpoint as dcp

    import yamlformer.builder.checkpoints.read as read
    import yamlformer.recipes.training.run

    counts, at_start = Counter(), Counter()

    def counted(kind, real, where):
        def call(*args, **kwargs):
            counts[(kind, str(Path(where(args, kwargs)).resolve()))] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(read, "_load", counted("load", read._load, lambda a, k: a[0]))
    monkeypatch.setattr(read, "verify", counted("verify", read.verify, lambda a, k: a[1]))
    monkeypatch.setattr(read, "verify_files", counted("shards", read.verify_files, lambda a, k: a[0]))
    monkeypatch.setattr(dcp, "load", counted("dcp", dcp.load, lambda a, k: k["checkpoint_id"]))

    class AtTrainStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            at_start.clear()
            at_start.update(counts)

    make = yamlformer.recipes.training.run.make_trainer

    def make_trainer(*args, **kwargs):
        trainer = make(*args, **kwargs)
        trainer.callbacks.insert(0, AtTrainStart())
        return trainer

    monkeypatch.setattr(yamlformer.recipes.training.run, "make_trainer", make_trainer)
    return at_start


def damaged_copy(source: Path, target: Path, how: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(DAMAGE[how](source.read_bytes()))
    return target


def _sealed(tmp_path: Path) -> Path:
    from yamlformer.builder.checkpoints import write_checkpoint

    checkpoint = {
        "state_dict": {"model.w": torch.arange(4096, dtype=torch.float32), "model.b": torch.ones(3)},
        "global_step": 7,
        "builder": {"history": {"train": [(1, 2.5)]}},
    }
    return write_checkpoint(checkpoint, tmp_path / "ckpt" / "last.ckpt")


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_every_kind_of_damage_is_one_error_naming_the_file(tmp_path, how):
    from yamlformer.builder.checkpoints import CheckpointError, DamagedCheckpointError, read_checkpoint

    good = _sealed(tmp_path)
    assert read_checkpoint(good)["global_step"] == 7
    bad = damaged_copy(good, tmp_path / "bad.ckpt", how)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(bad)
    assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, DamagedCheckpointError), str(caught.value)


def test_a_flipped_bit_in_a_tensor_or_the_step_is_caught(tmp_path):
    from yamlformer.builder.checkpoints import DamagedCheckpointError, read_checkpoint

    good = _sealed(tmp_path)
    data = bytearray(good.read_bytes())
    at = data.find(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[4000:4016])
    data[at] ^= 0x01  # inside model.w: torch.load alone reads this without a word
    (tmp_path / "tensor.ckpt").write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match="tensor state_dict/model.w does not match its checksum"):
        read_checkpoint(tmp_path / "tensor.ckpt")
    checkpoint = torch.load(good, weights_only=True)
    checkpoint["global_step"] = 8  # as if a byte of the pickle changed the step
    torch.save(checkpoint, tmp_path / "step.ckpt")
    with pytest.raises(DamagedCheckpointError, match="step, loop state or metadata"):
        read_checkpoint(tmp_path / "step.ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_files_are_checked_by_their_checksums(tmp_path):
    import torch.distributed.checkpoint as dcp

    from yamlformer.builder.checkpoints import DamagedCheckpointError, file_digests, verify_files

    folder = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(1000.0)}}, checkpoint_id=str(folder), no_dist=True)
    names = sorted(p.name for p in folder.iterdir())
    record = file_digests(folder, names)
    verify_files(folder, record)
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=f"{shard.name} does not match its checksum"):
        verify_files(folder, record)


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_eval_generate_and_export_name_a_damaged_checkpoint_in_one_line(unbroken_run, tmp_path, capsys, how):
    from yamlformer.builder.cli import main

    _, summary = unbroken_run
    bad = damaged_copy(Path(summary["last"]), tmp_path / "checkpoints" / "last.ckpt", how)
    for argv, prefix in (
        (["eval", str(bad), "--max-batches", "1"], "builder eval:"),
        (["generate", str(bad), "--prompt", "def ", "--max-new-tokens", "4"], "builder generate:"),
        (["export-hf", str(bad), "-o", str(tmp_path / "hf")], "error:"),
    ):
        assert main(argv) == 1, argv
        line = one_error_line(capsys.readouterr().err, prefix)
        assert str(bad) in line and "damaged" in line, line
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_from_before_checksums_loads_with_a_note(unbroken_run, tmp_path, capsys):
    from yamlformer.builder.cli import main

    _, summary = unbroken_run
    old = torch.load(summary["last"], map_location="cpu", weights_only=True)
    old.pop("integrity")
    torch.save(old, tmp_path / "old.ckpt")
    assert main(["eval", str(tmp_path / "old.ckpt"), "--max-batches", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "has no checksums" in captured.err and '"loss"' in captured.out


def _copy_run(summary: dict, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(summary["output_dir"], run)
    (run / "run.lock").unlink(missing_ok=True)
    return run


def test_resume_falls_back_to_the_newest_intact_checkpoint(unbroken_run, tmp_path, capsys):
    from yamlformer.builder.cli import main

    recipe, summary = unbroken_run
    run = _copy_run(summary, tmp_path)
    last, previous = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "last-1.ckpt"
    assert torch.load(previous, weights_only=True)["global_step"] == 8
    damaged_copy(Path(summary["last"]), last, "bit-flipped")
    (run / "checkpoints" / "best.ckpt").unlink()  # best is at step 12 too: make last-1 the newest intact
    assert main(["train", str(recipe), "--no-samples", "--set", f"trainer.output_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert f"{last} is damaged" in out and f"resuming from {previous} (step 8) instead" in out
    assert (run / "checkpoints" / "last.ckpt.damaged").is_file()
    assert_same_run(last, Path(summary["last"]))  # steps 8 to 12 again: the same losses and weights


def test_no_intact_checkpoint_left_is_an_error_and_resume_path_must_be_whole(unbroken_run, tmp_path, capsys):
    from yamlformer.builder.cli import main

    recipe, summary = unbroken_run
    run = _copy_run(summary, tmp_path)
    for name in ("last.ckpt", "last-1.ckpt", "best.ckpt"):
        damaged_copy(run / "checkpoints" / name, run / "checkpoints" / name, "truncated")
    assert main(["train", str(recipe), "--no-samples", "--set", f"trainer.output_dir={run}"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert "no intact checkpoint" in line and "--fresh" in line
    bad = damaged_copy(Path(summary["last"]), tmp_path / "given.ckpt", "garbage")
    assert (
        main(
            [
                "train",
                str(recipe),
                "--no-samples",
                "--set",
                f"trainer.output_dir={tmp_path / 'other'}",
                "--resume",
                str(bad),
            ]
        )
        == 1
    )
    line = one_error_line(capsys.readouterr().err, "builder train:")
    assert line.startswith(f"builder train: --resume: {bad} is damaged")
    assert [s for s, _ in history(Path(summary["last"]))["train"]] == list(range(2, 13, 2))  # untouched
