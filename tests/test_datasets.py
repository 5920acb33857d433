"""The dataset registry: downloads from a local HTTP server (the real files when a local copy is
here, generated stand-ins with their own checksums otherwise), verified, atomic, reused; an
offline folder used as it is; every failure one line that names the URL and the override, with
nothing left behind."""

from __future__ import annotations

import gzip
import hashlib
import time
from pathlib import Path

import pytest
import yaml
from data_helpers import Server, real_data_root, stand_in, stand_in_files

from yamlformer.recipes.data import registry as datasets
from yamlformer.recipes.data.registry import DatasetError

SHAKESPEARE = "tinyshakespeare.txt"
VAL = ("multi30k/val.de", "multi30k/val.en")


def _contents() -> tuple[dict[str, bytes], str]:
    """Tiny Shakespeare and Multi30k's val split: real when a local copy exists, else stand-ins."""
    real = real_data_root(SHAKESPEARE, *VAL)
    if real is not None:
        return {p: (real / p).read_bytes() for p in (SHAKESPEARE, *VAL)}, "real"
    generated = {**stand_in_files("tinyshakespeare"), **stand_in_files("multi30k")}
    return {p: generated[p] for p in (SHAKESPEARE, *VAL)}, "stand-in"


@pytest.fixture
def served(monkeypatch):
    """A local server holding the files, the registry pointed at it (with the stand-ins'
    checksums when the real files are not here). Yields ``(server, contents)``."""
    contents, kind = _contents()
    monkeypatch.setattr(datasets, "_NOTICED", set())  # terms are printed once a process: this one is new
    with Server() as server:
        for name in ("tinyshakespeare", "multi30k"):
            dataset = datasets.DATASETS[name]
            if kind == "stand-in":
                dataset = stand_in(name, contents, server.url)
            else:  # the registry's own checksums, only the URLs local
                dataset = stand_in(name, {}, server.url)
            monkeypatch.setitem(datasets.DATASETS, name, dataset)
            for remote in dataset.files:
                if remote.path in contents:
                    server.serve(remote, contents[remote.path])
        yield server, contents


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_first_use_downloads_verifies_and_then_reuses(served, tmp_path, monkeypatch, capsys):
    server, contents = served
    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "data"))
    found = datasets.split_files("multi30k", "val")
    assert found == {"de": tmp_path / "data" / "multi30k" / "val.de", "en": tmp_path / "data" / "multi30k" / "val.en"}
    for lang, path in found.items():
        assert path.read_bytes() == contents[f"multi30k/val.{lang}"]  # served gzipped, stored unpacked
    [text] = datasets.text_files("tinyshakespeare")
    assert text.read_bytes() == contents[SHAKESPEARE]
    err = capsys.readouterr().err
    assert "multi30k" in err and "non-commercial research and educational use" in err  # its terms, when fetched
    assert f"downloading {server.url}/multi30k/val.de.gz -> {found['de']}" in err
    assert _files(tmp_path / "data") == [*VAL, SHAKESPEARE]

    hits = len(server.hits)
    assert datasets.split_files("multi30k", "val") == found and datasets.text_files("tinyshakespeare") == [text]
    assert len(server.hits) == hits and "downloading" not in capsys.readouterr().err


def test_a_folder_with_the_files_is_used_offline(served, tmp_path, monkeypatch):
    server, contents = served
    for path, data in contents.items():
        (tmp_path / "copy" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "copy" / path).write_bytes(data)
    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "elsewhere"))
    found = datasets.split_files("multi30k", "val", root=tmp_path / "copy")  # data.root beats BUILDER_DATA
    assert found["de"] == tmp_path / "copy" / "multi30k" / "val.de"
    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "copy"))
    assert datasets.text_files("tinyshakespeare") == [tmp_path / "copy" / SHAKESPEARE]
    assert server.hits == [] and not (tmp_path / "elsewhere").exists()


def test_the_default_root_is_the_platform_cache(monkeypatch, tmp_path):
    import platformdirs

    monkeypatch.delenv("BUILDER_DATA", raising=False)
    assert datasets.default_root() == Path(platformdirs.user_cache_dir("builder", appauthor=False)) / "data"
    monkeypatch.setenv("BUILDER_DATA", str(tmp_path))
    assert datasets.data_root() == tmp_path and datasets.data_root(tmp_path / "x") == tmp_path / "x"


def _one_line_error(excinfo, url: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and url in message and "BUILDER_DATA" in message, message
    return message


@pytest.mark.parametrize("what", ["wrong checksum", "dropped connection", "not found", "cut gzip"])
def test_failed_downloads_are_one_line_and_leave_nothing(served, tmp_path, what):
    server, contents = served
    dataset = datasets.DATASETS["multi30k"]
    remote = dataset.file("multi30k/val.de")
    if what == "wrong checksum":
        server.serve(remote, contents["multi30k/val.de"] + b"one more line\n")
    elif what == "dropped connection":
        server.serve(remote, contents["multi30k/val.de"], "drop")
    elif what == "not found":
        server.routes.clear()
    else:  # no Content-Length, so only gzip's own check sees the end is missing
        body = gzip.compress(contents["multi30k/val.de"], mtime=0)
        server.routes["/multi30k/val.de.gz"] = ("nolength", body[: len(body) // 2])
    with pytest.raises(DatasetError) as excinfo:
        datasets.split_files("multi30k", "val", root=tmp_path / "data")
    message = _one_line_error(excinfo, f"{server.url}/multi30k/val.de.gz")
    expected = {
        "wrong checksum": "sha256",
        "dropped connection": "closed after",
        "not found": "HTTP 404",
        "cut gzip": "not a whole gzip file",
    }[what]
    assert expected in message, message
    assert _files(tmp_path) == [] and not (tmp_path / "data").exists()


def test_a_stalled_server_times_out(served, tmp_path, monkeypatch):
    server, contents = served
    server.serve(datasets.DATASETS["tinyshakespeare"].files[0], b"", "stall")
    monkeypatch.setenv("BUILDER_DATA_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(DatasetError) as excinfo:
        datasets.text_files("tinyshakespeare", root=tmp_path / "data")
    assert time.monotonic() - start < 10
    assert "timed out" in _one_line_error(excinfo, f"{server.url}/{SHAKESPEARE}")
    assert _files(tmp_path) == []
    monkeypatch.setenv("BUILDER_DATA_TIMEOUT", "soon")
    with pytest.raises(DatasetError, match="BUILDER_DATA_TIMEOUT"):
        datasets.text_files("tinyshakespeare", root=tmp_path / "data")


def test_an_interrupted_download_leaves_nothing(served, tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets, "_gunzip", interrupted)  # after the download, before the rename
    with pytest.raises(KeyboardInterrupt):
        datasets.split_files("multi30k", "val", root=tmp_path / "data")
    assert _files(tmp_path) == []


def test_a_wrong_local_file_is_refused_and_kept(served, tmp_path):
    server, _ = served
    bad = tmp_path / SHAKESPEARE
    bad.write_text("not Shakespeare\n")
    with pytest.raises(DatasetError) as excinfo:
        datasets.text_files("tinyshakespeare", root=tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message and str(bad) in message and "BUILDER_DATA" in message and "sha256" in message
    assert bad.read_text() == "not Shakespeare\n" and server.hits == []


def test_registry_entries_are_whole():
    for name, dataset in datasets.DATASETS.items():
        assert dataset.name == name and dataset.license and dataset.how_to_split
        assert bool(dataset.files) != (dataset.local is not None), name
        for split in (dataset.train, dataset.validation, dataset.test):
            assert split is None or split in dataset.splits or dataset.local, (name, split)
        paths = [p for files in dataset.splits.values() for p in files.values()]
        assert sorted(paths) == sorted(f.path for f in dataset.files), name
        for remote in dataset.files:
            assert len(remote.sha256) == 64 and remote.url.startswith("https://") and remote.size > 0
    assert datasets.DATASETS["multi30k"].restricted and datasets.DATASETS["multi30k"].keys == ["de", "en"]
    real = real_data_root(*(f.path for f in datasets.DATASETS["tinyshakespeare"].files), *VAL)
    if real is None:
        pytest.skip("no local copy of the data to check the registry's checksums against")
    for name in ("tinyshakespeare", "multi30k"):
        for remote in datasets.DATASETS[name].files:
            if (real / remote.path).is_file():
                data = (real / remote.path).read_bytes()
                assert (hashlib.sha256(data).hexdigest(), len(data)) == (remote.sha256, remote.size), remote.path


def _recipe(tmp_path: Path, data: dict, task: str = "lm") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"task": task, "model": {"spec": "x.yaml"}, "data": data}))
    return path


def test_recipes_name_datasets_and_typos_are_located(tmp_path):
    from yamlformer.builder.spec.loader import SpecError
    from yamlformer.recipes.tasks import load_recipe

    recipe = load_recipe(_recipe(tmp_path, {"dataset": "tinyshakespeare", "root": "data"})).recipe
    assert recipe.data.corpus() == ["tinyshakespeare"] and recipe.data.val_fraction == 0.1  # the dataset's split
    assert recipe.data.dataset_root(tmp_path / "recipe.yaml") == tmp_path / "data"
    assert (
        load_recipe(_recipe(tmp_path, {"dataset": "tinyshakespeare", "val_fraction": 0.2})).recipe.data.val_fraction
        == 0.2
    )
    default = load_recipe(_recipe(tmp_path, {})).recipe
    assert default.data.corpus() == ["python-stdlib"]
    assert load_recipe(_recipe(tmp_path, {"sources": ["notes.txt"]})).recipe.data.corpus() == ["notes.txt"]
    with pytest.raises(SpecError, match=r"recipe.yaml:\d+:\d+: data.dataset: .*did you mean 'tinyshakespeare'"):
        load_recipe(_recipe(tmp_path, {"dataset": "tinyshakespear"}))
    translation = load_recipe(
        _recipe(tmp_path, {"dataset": "multi30k", "source_lang": "de", "target_lang": "en"}, "translation")
    ).recipe
    assert translation.data.train is None and translation.data.source_lang == "de"
    with pytest.raises(SpecError, match="two of multi30k's languages"):
        load_recipe(_recipe(tmp_path, {"dataset": "multi30k", "source_lang": "de", "target_lang": "fr"}, "translation"))
    with pytest.raises(SpecError, match="data.dataset .* or data.train and data.validation"):
        load_recipe(_recipe(tmp_path, {}, "translation"))
    labelled = load_recipe(_recipe(tmp_path, {"dataset": "multi30k", "split": "val"}, "classification")).recipe
    assert labelled.data.split == "val"
    with pytest.raises(SpecError, match="data.split 'dev'"):
        load_recipe(_recipe(tmp_path, {"dataset": "multi30k", "split": "dev"}, "classification"))


def test_a_recipe_reads_a_dataset_from_its_root(tmp_path, monkeypatch):
    from yamlformer.recipes.data.corpus import read_corpus
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.tasks.classification.training import labelled_examples
    from yamlformer.recipes.tasks.translation.training import pair_paths

    contents = {**stand_in_files("tinyshakespeare"), **stand_in_files("multi30k")}
    for name in ("tinyshakespeare", "multi30k"):
        monkeypatch.setitem(datasets.DATASETS, name, stand_in(name, contents))
    for path, data in contents.items():
        (tmp_path / "data" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / path).write_bytes(data)
    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "nowhere"))
    path = _recipe(tmp_path, {"dataset": "tinyshakespeare", "root": "data", "max_bytes": None})
    corpus = read_corpus(load_recipe(path).recipe.data, path)
    assert corpus.text == contents[SHAKESPEARE].decode()
    path = _recipe(
        tmp_path, {"dataset": "multi30k", "root": "data", "source_lang": "en", "target_lang": "de"}, "translation"
    )
    assert pair_paths(load_recipe(path).recipe.data, path, "validation") == (
        tmp_path / "data" / "multi30k" / "val.en",
        tmp_path / "data" / "multi30k" / "val.de",
    )
    path = _recipe(tmp_path, {"dataset": "multi30k", "root": "data", "split": "test2016"}, "classification")
    train, val = labelled_examples(load_recipe(path).recipe.data, path, seed=0)
    assert {label for _, label in train + val} == {"de", "en"} and len(train) + len(val) == 240
    assert not (tmp_path / "nowhere").exists()
