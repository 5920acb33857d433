"""Commands that write a model never write over their own input, never over an earlier model
without `--overwrite`, and say only what they wrote (yamlformer.builder.outputs): `import-hf`
into its own folder used to replace the Hugging Face weights with ours, `export-hf` into another
export replaced it without a word, and into a folder of checkpoints it claimed the checkpoints.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.hf import to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hf(tmp_path) -> Path:
    """A Hugging Face GPT-2 folder (our exporter's) with a generation config beside the weights."""
    spec = load_spec(REPO / "specs" / "tiny" / "gpt2.yaml")
    torch.manual_seed(0)
    to_hf(spec, build_model(spec), tmp_path / "hf")
    return tmp_path / "hf"


def _digests(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_import_into_its_own_folder_is_refused_even_with_overwrite(hf, capsys):
    before = _digests(hf)
    for extra in ([], ["--overwrite"]):
        assert main(["import-hf", str(hf), "-o", str(hf), *extra]) == 1
        err = capsys.readouterr().err
        assert "is the folder this command reads" in err and err.count("\n") == 1
    assert _digests(hf) == before  # the source model is as it was: nothing written, nothing removed


def test_a_second_import_or_export_into_a_model_needs_overwrite(hf, tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import-hf", str(hf), "-o", str(imported)]) == 0
    first = _digests(imported)
    assert main(["import-hf", str(hf), "-o", str(imported), "--name", "other"]) == 1
    err = capsys.readouterr().err
    assert "already holds" in err and "model.safetensors" in err and "--overwrite" in err
    assert _digests(imported) == first
    assert main(["import-hf", str(hf), "-o", str(imported), "--name", "other", "--overwrite"]) == 0
    assert "name: other" in (imported / "spec.yaml").read_text()

    exported = tmp_path / "exported"
    assert main(["export-hf", str(imported / "spec.yaml"), "-o", str(exported)]) == 0
    first = _digests(exported)
    assert main(["export-hf", str(imported / "spec.yaml"), "-o", str(exported), "--hf-config", "pad_token_id=0"]) == 1
    assert "already holds config.json" in capsys.readouterr().err
    assert _digests(exported) == first
    assert (
        main(
            ["export-hf", str(imported / "spec.yaml"), "-o", str(exported), "--overwrite", "--hf-config=pad_token_id=0"]
        )
        == 0
    )
    assert json.loads((exported / "config.json").read_text())["pad_token_id"] == 0


def test_export_never_writes_over_the_weights_it_reads(hf, tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import-hf", str(hf), "-o", str(imported)]) == 0
    weights = load_file(imported / "model.safetensors")
    for extra in ([], ["--overwrite"]):
        assert main(["export-hf", str(imported / "spec.yaml"), "-o", str(imported), *extra]) == 1
        assert "which this command reads" in capsys.readouterr().err
    again = load_file(imported / "model.safetensors")
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    # a link to the input is the input
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "model.safetensors").symlink_to(imported / "model.safetensors")
    argv = ["export-hf", str(imported / "spec.yaml"), "-o", str(tmp_path / "linked"), "--overwrite"]
    assert main(argv) == 1
    assert "which this command reads" in capsys.readouterr().err


def test_export_into_a_folder_of_checkpoints_names_only_what_it_wrote(hf, tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import-hf", str(hf), "-o", str(imported)]) == 0
    runs = tmp_path / "checkpoints"
    runs.mkdir()
    for name in ("last.ckpt", "best.ckpt", "notes.txt"):
        (runs / name).write_text("not ours")
    capsys.readouterr()
    assert main(["export-hf", str(imported / "spec.yaml"), "-o", str(runs)]) == 0
    line = capsys.readouterr().out
    assert "model.safetensors" in line and "config.json" in line
    assert "last.ckpt" not in line and "best.ckpt" not in line and "notes.txt" not in line
    assert (runs / "last.ckpt").read_text() == "not ours"


def test_consolidate_refuses_an_existing_file_and_its_own_checkpoint(tmp_path, capsys):
    spec = load_spec(REPO / "specs" / "tiny" / "gpt2.yaml")
    model = build_model(spec)
    checkpoint = tmp_path / "last.ckpt"
    torch.save(
        {
            "builder": {"spec": spec.model_dump(mode="json")},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        checkpoint,
    )
    out = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(1)}, out)
    assert main(["consolidate", str(checkpoint), "-o", str(out)]) == 1
    assert "exists; add --overwrite" in capsys.readouterr().err
    assert list(load_file(out)) == ["x"]
    assert main(["consolidate", str(checkpoint), "-o", str(out), "--overwrite"]) == 0
    assert "x" not in load_file(out)


def test_an_empty_name_is_refused_not_replaced(hf, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["import-hf", str(hf), "-o", str(tmp_path / "out"), "--name", " "])
    assert stop.value.code == 2
    assert "--name: takes at least 1 character" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_weights_with_nan_are_refused_naming_the_tensor(hf, tmp_path, capsys):
    state = load_file(hf / "model.safetensors")
    name = next(k for k in state if k.endswith("ln_f.weight"))
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["import-hf", str(hf), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"tensor {name} holds {state[name].numel():,} NaN values" in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_one_file_outputs_replace_only_a_regular_file_even_with_overwrite(tmp_path, capsys):
    """The output is renamed over: with --overwrite a FIFO, a folder or (as root) /dev/null used
    to be replaced by the written file (yamlformer.builder.outputs.claim_file)."""
    spec = load_spec(REPO / "specs" / "tiny" / "gpt2.yaml")
    checkpoint = tmp_path / "last.ckpt"
    state = build_model(spec).state_dict()
    torch.save(
        {"builder": {"spec": spec.model_dump(mode="json")}, "state_dict": {f"model.{k}": v for k, v in state.items()}},
        checkpoint,
    )
    fifo, folder = tmp_path / "fifo.safetensors", tmp_path / "folder.safetensors"
    os.mkfifo(fifo)
    folder.mkdir()
    for out, why in ((fifo, "is a FIFO (named pipe)"), (folder, "is a folder, not a file")):
        assert main(["consolidate", str(checkpoint), "-o", str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"-o {out}: {why}" in err and "only a regular file" in err
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and folder.is_dir() and not any(folder.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.safetensors", "folder.safetensors", "last.ckpt"]
    if os.geteuid() == 0:  # only root could have replaced the device node
        assert main(["export-gguf", "tiny/llama", "--init", "--overwrite", "-o", os.devnull]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"-o {os.devnull}: is a character device" in err
        assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
