"""Hostile and broken Hugging Face folders given to `builder import-hf` (and a training
checkpoint to `export-hf`): each is refused with exit status 1 and one line naming the file and
the key or tensor, never a traceback, and no file outside the folder is ever opened.

The folders are written by our own exporter from specs/tiny/gpt2.yaml (transformers is not
needed), then damaged.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.hf import from_hf, to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
_OPENED: list[str] | None = None  # paths opened while a test records them


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one records only inside `opened`


@pytest.fixture
def opened(monkeypatch):
    """Every path opened during the test: Python's open() through an audit hook, and the
    safetensors readers (which open files in Rust) through wrappers."""
    global _OPENED
    import safetensors
    import safetensors.torch

    _OPENED = []
    record = _OPENED
    real_open, real_load = safetensors.safe_open, safetensors.torch.load_file

    def safe_open(path, *args, **kwargs):
        record.append(os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    def load_file(path, *args, **kwargs):
        record.append(os.fsdecode(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    yield record
    _OPENED = None


def _export(folder: Path) -> Path:
    spec = load_spec(REPO / "specs" / "tiny" / "gpt2.yaml")
    torch.manual_seed(0)
    to_hf(spec, build_model(spec), folder)
    return folder


@pytest.fixture
def hf(tmp_path) -> Path:
    return _export(tmp_path / "hf")


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _set(folder: Path, **values) -> None:
    config = _config(folder)
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


def _refused(folder: Path, capsys, *needles: str, command: str = "import-hf") -> str:
    """Run the command; assert exit 1, no traceback, one line on stderr holding every needle."""
    out = folder.parent / "out"
    assert main([command, str(folder), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "weights_only" not in err
    assert "\n" not in err, f"more than one line:\n{err}"
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    return err


def test_the_undamaged_folder_imports(hf, tmp_path):
    assert main(["import-hf", str(hf), "-o", str(tmp_path / "out")]) == 0


# --- config.json -------------------------------------------------------------------------


def test_wrong_n_embd_names_the_key_and_the_tensor(hf, capsys):
    _set(hf, n_embd=96)  # the weights hold 64
    err = _refused(hf, capsys, "config.json", "n_embd = 96", "transformer.wte.weight", "(256, 64)", "(256, 96)")
    assert "model.safetensors" in err


def test_more_layers_than_the_weights_names_the_missing_tensor(hf, capsys):
    _set(hf, n_layer=3)
    _refused(hf, capsys, "transformer.h.2.", "config.json implies")


def test_fewer_layers_than_the_weights_names_the_extra_tensor(hf, capsys):
    _set(hf, n_layer=1)
    _refused(hf, capsys, "transformer.h.1.", "not part of a gpt2 model")


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("n_layer", "two", "expected an integer"),
        ("n_layer", True, "expected an integer"),
        ("n_layer", 10**12, "expected an integer from 1 to 10,000"),
        ("n_embd", -64, "expected an integer"),
        ("vocab_size", 1.5, "expected an integer"),
        ("n_head", [4], "got a list"),
        ("layer_norm_epsilon", "tiny", "expected a finite number"),
        ("tie_word_embeddings", "yes", "expected true or false"),
        ("activation_function", 3, "expected a string"),
        ("eos_token_id", "</s>", "expected a token id"),
        ("rope_scaling", [], "expected a mapping"),
    ],
)
def test_a_value_of_the_wrong_kind_names_its_key(hf, capsys, key, value, needle):
    _set(hf, **{key: value})
    _refused(hf, capsys, "config.json", key, needle)


def test_non_finite_numbers_are_refused(hf, capsys):
    text = (hf / "config.json").read_text().replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": NaN')
    assert "NaN" in text
    (hf / "config.json").write_text(text)
    _refused(hf, capsys, "config.json", "layer_norm_epsilon", "finite")


def test_values_that_make_no_model_name_the_key(hf, capsys):
    heads = _config(hf)["n_head"]
    _set(hf, n_head=0)
    _refused(hf, capsys, "config.json", "n_head", "from 1")
    _set(hf, n_head=heads, layer_norm_epsilon=-1.0)
    _refused(hf, capsys, "config.json", "layer_norm_epsilon", "greater than 0")
    _set(hf, layer_norm_epsilon=1e-5, n_head=5)  # 64 is not a multiple of 5
    _refused(hf, capsys, "config.json", "n_heads")


def test_unknown_or_missing_model_type(hf, capsys):
    _set(hf, model_type=["gpt2"])
    _refused(hf, capsys, "config.json: model_type: expected a string, got a list")
    _set(hf, model_type=None)
    assert main(["import-hf", str(hf), "-o", str(hf.parent / "out")]) == 1
    err = capsys.readouterr().err
    assert "config.json: model_type (absent) is not supported" in err and "Traceback" not in err
    _set(hf, model_type="Root:x:0:0")  # text not shaped like a family name is not printed
    assert main(["import-hf", str(hf), "-o", str(hf.parent / "out")]) == 1
    err = capsys.readouterr().err
    assert "config.json: model_type (not a family name) is not supported" in err and "Root" not in err
    _set(hf, model_type="mamba")
    assert main(["import-hf", str(hf), "-o", str(hf.parent / "out")]) == 1
    assert "config.json: model_type 'mamba' is not supported" in capsys.readouterr().err


def test_binary_config(hf, capsys):
    (hf / "config.json").write_bytes(bytes(range(256)) * 4)
    _refused(hf, capsys, "config.json", "not UTF-8")


def test_config_that_is_not_json_or_not_an_object(hf, capsys):
    (hf / "config.json").write_text("model_type: gpt2\nsecret: do not print me\n")
    err = _refused(hf, capsys, "config.json", "not valid JSON")
    assert "secret" not in err
    (hf / "config.json").write_text("[1, 2]")
    _refused(hf, capsys, "config.json", "not a JSON object")


def test_config_nested_100000_deep(hf, capsys):
    (hf / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    _refused(hf, capsys, "config.json", "nested too deeply")


def test_huge_config_is_refused_before_it_is_read(hf, capsys, opened):
    with open(hf / "config.json", "r+b") as f:
        f.truncate(300 * 2**20)  # sparse: 300 MiB on paper
    opened.clear()
    _refused(hf, capsys, "config.json", "300 MiB", "at most 16 MiB")
    assert not any(p.endswith("config.json") for p in opened)


def test_config_that_is_a_symlink_out_of_the_folder(hf, tmp_path, capsys, opened):
    (tmp_path / "elsewhere.json").write_text(json.dumps(_config(hf)))
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to(tmp_path / "elsewhere.json")
    opened.clear()
    _refused(hf, capsys, "config.json", "leads outside")
    assert not any(p.endswith("elsewhere.json") for p in opened)


def test_symlink_loop(hf, capsys):
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to(hf / "config.json")
    _refused(hf, capsys, "config.json", "symlink loop")


# --- weights -----------------------------------------------------------------------------


def _sharded(hf: Path, file_name: str) -> None:
    """An index that sends every tensor to ``file_name`` (it is read before model.safetensors)."""
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, file_name)}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_index_naming_a_file_outside_the_folder_is_never_opened(hf, tmp_path, capsys, opened, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = {
        "dotdot": "../outside/stolen.safetensors",
        "absolute": str(outside / "stolen.safetensors"),
        "symlink": "link.safetensors",
    }[how]
    _sharded(hf, target)
    (hf / "model.safetensors").rename(outside / "stolen.safetensors")  # would import fine if read
    if how == "symlink":
        (hf / "link.safetensors").symlink_to(outside / "stolen.safetensors")
    opened.clear()
    _refused(hf, capsys, "model.safetensors.index.json", "weight_map[", "leads outside")
    assert not [p for p in opened if "outside" in p], opened


def test_shard_index_faults(hf, capsys):
    _sharded(hf, "missing-00001.safetensors")
    _refused(hf, capsys, "model.safetensors.index.json", "missing-00001.safetensors", "is not in")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    _refused(hf, capsys, "model.safetensors.index.json", "weight_map: expected a mapping")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": 7}}))
    _refused(hf, capsys, "model.safetensors.index.json", "weight_map['transformer.wte.weight']")


def test_weights_symlinked_out_of_the_folder(hf, tmp_path, capsys, opened):
    (hf / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (hf / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    opened.clear()
    _refused(hf, capsys, "model.safetensors", "leads outside")
    assert not any("elsewhere" in p for p in opened)


def test_hub_cache_layout_reads_through_its_blob_symlinks(hf, tmp_path):
    """huggingface_hub keeps files in <repo>/blobs and links them from snapshots/<rev>/."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(hf.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    _, state = from_hf(snapshot)
    assert "decoder.embedding.tokens.weight" in state


def test_truncated_safetensors(hf, capsys):
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(hf, capsys, "model.safetensors", "damaged")


def test_garbage_safetensors(hf, capsys):
    (hf / "model.safetensors").write_bytes(os.urandom(4096))
    _refused(hf, capsys, "model.safetensors", "not a safetensors file")


class _NotATensor:
    def __reduce__(self):  # unpickling would run this call, if it were ever allowed
        return (os.system, ("echo pwned > pwned.txt",))


def _as_bin(hf: Path, payload) -> None:
    (hf / "model.safetensors").unlink()
    torch.save(payload, hf / "pytorch_model.bin")


def test_unsafe_pickle_bin_is_refused_without_running_it(hf, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _as_bin(hf, {"transformer.wte.weight": _NotATensor()})
    _refused(hf, capsys, "pytorch_model.bin", "not a checkpoint this tool can load safely")
    assert not (tmp_path / "pwned.txt").exists()


def test_tensor_only_bin_imports_and_garbage_bin_is_refused(hf, tmp_path, capsys):
    from safetensors.torch import load_file

    _as_bin(hf, load_file(hf / "model.safetensors") if (hf / "model.safetensors").exists() else {})
    assert main(["import-hf", str(hf), "-o", str(tmp_path / "ok")]) == 0
    (hf / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + os.urandom(200))  # a broken zip
    _refused(hf, capsys, "pytorch_model.bin", "not a PyTorch weights file, or a damaged one")
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle at all" * 10)
    _refused(hf, capsys, "pytorch_model.bin", "not a checkpoint this tool can load safely")
    torch.save([1, 2, 3], hf / "pytorch_model.bin")
    _refused(hf, capsys, "pytorch_model.bin", "does not hold a state dict")


def test_unsafe_training_checkpoint_given_to_export(tmp_path, capsys):
    torch.save({"builder": _NotATensor()}, tmp_path / "last.ckpt")
    _refused(
        tmp_path / "last.ckpt", capsys, "last.ckpt", "not a checkpoint this tool can load safely", command="export-hf"
    )


# --- tokenizer files ---------------------------------------------------------------------


def test_tokenizer_symlinked_out_of_the_folder_is_never_opened(hf, tmp_path, capsys, opened):
    (tmp_path / "secret.json").write_text('{"version": "1.0"}')
    (hf / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    opened.clear()
    _refused(hf, capsys, "tokenizer.json", "leads outside")
    assert not any("secret" in p for p in opened)


def test_damaged_tokenizer_files(hf, capsys):
    (hf / "tokenizer.model").write_bytes(b"\xff" * 64)
    _refused(hf, capsys, "tokenizer.model", "not a sentencepiece model")
    (hf / "tokenizer.model").write_bytes(b"")
    _refused(hf, capsys, "tokenizer.model", "no pieces")
    (hf / "tokenizer.json").write_bytes(b"\xff\xfe binary")
    _refused(hf, capsys, "tokenizer.json", "not UTF-8")
    (hf / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    _refused(hf, capsys, "tokenizer.json", "not a tokenizer the tokenizers library can load")
