"""The files a recipe reads, judged once (``yamlformer.builder.paths``): a device such as
``/dev/zero``, a FIFO, a socket or a file that cannot be read, named where a recipe reads data,
is refused by ``builder validate`` as ``builder train`` (and its dry run) refuses it, with the same
located line (file, line, field), exit status 1, no traceback, nothing written, nothing of the
file printed; and opening a FIFO never blocks."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path

import pytest
import yaml
from hostile_helpers import bounded_run, cli, refused
from recipe_helpers import tiny_recipe

SECRET = "the user's secret words"


@contextlib.contextmanager
def as_nobody(drop: bool = True):
    """This process with another user's permissions for the block (root reads every file): the
    effective user is dropped to ``nobody`` and restored; a non-root user is left as it is. What
    the commands import is imported first, as root (``nobody`` may not read the interpreter's
    own library)."""
    if not drop or os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def _source(kind: str, folder: Path) -> Path:
    """A path of ``kind`` under ``folder`` (kept short: a socket's name is at most 107 bytes)."""
    path = folder / kind
    if kind == "device":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        return Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(path)  # no writer: opening it for reading would block for ever
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    elif kind == "unreadable":
        path.write_text(SECRET)
        path.chmod(0)
    return path


WHAT = {
    "device": "is a character device, not a file or folder",
    "fifo": "is a FIFO (named pipe), not a file or folder",
    "socket": "is a socket, not a file or folder",
    "unreadable": "permission denied",
}


@pytest.fixture
def folder():
    """A folder another user can enter (pytest's own are its owner's only): the unreadable case
    runs as ``nobody``, which must reach the recipe and be refused the data file alone."""
    with tempfile.TemporaryDirectory() as name:
        os.chmod(name, 0o755)
        yield Path(name)


def _agree(capsys, recipe: Path, field: str, path: Path, what: str) -> None:
    """validate, train --dry-run and train give one located line, the same, exit 1, nothing written."""
    line = next(n for n, text in enumerate(recipe.read_text().splitlines(), 1) if str(path) in text)
    lines = []
    unreadable = what == WHAT["unreadable"]
    if unreadable:  # the same commands refusing a FIFO first: what they import is imported as root
        warm = recipe.parent / "warm"
        warm.mkdir()
        fifo = _source("fifo", warm)
        data = {"sources": [str(fifo)], "seq_len": 32, "batch_size": 4, "cache_dir": str(warm / "cache")}
        for argv in (["validate"], ["train", "--dry-run"], ["train"]):
            cli(capsys, argv[0], tiny_recipe(warm, data=data), *argv[1:])
    with as_nobody(unreadable):
        checked = cli(capsys, "validate", recipe)
        dry = cli(capsys, "train", recipe, "--dry-run")
        run = cli(capsys, "train", recipe)
    assert checked.status == 1 and "1 problem" in checked.out, checked.text
    lines.append(checked.out.splitlines()[0])
    for result in (dry, run):
        lines.append(refused(result, 1, f"{path}: {what}"))
    expected = f"{recipe}:{line}:"
    assert all(text.startswith(expected) and f" {field}: {path}: {what}" in text for text in lines), lines
    assert len(set(lines)) == 1, lines
    for result in (checked, dry, run):
        assert SECRET not in result.text and "Traceback" not in result.text
    assert not (recipe.parent / "run").exists() and not (recipe.parent / "cache").exists()


def _writable(recipe: Path) -> None:
    os.chmod(recipe, 0o644)


@pytest.mark.parametrize("kind", ["device", "fifo", "socket", "unreadable"])
def test_an_lm_source_that_is_no_readable_file(capsys, folder, kind):
    path = _source(kind, folder)
    data = {"sources": [str(path)], "seq_len": 32, "batch_size": 4, "cache_dir": str(folder / "cache")}
    recipe = tiny_recipe(folder, data=data)
    _writable(recipe)
    _agree(capsys, recipe, "data.sources.0", path, WHAT[kind])


@pytest.mark.parametrize("kind", ["fifo", "unreadable"])
def test_sft_records_that_are_no_readable_file(capsys, folder, kind):
    path = _source(kind, folder)
    data = {"file": str(path), "seq_len": 32, "batch_size": 4, "cache_dir": str(folder / "cache")}
    recipe = tiny_recipe(folder, data=data)
    document = yaml.safe_load(recipe.read_text())
    document["task"], document["data"] = "sft", data
    del document["sample"]
    recipe.write_text(yaml.safe_dump(document, sort_keys=False))
    _writable(recipe)
    _agree(capsys, recipe, "data.file", path, WHAT[kind].replace(" or folder", ""))


def test_a_weighted_source_and_a_validation_file_are_located_at_their_own_lines(capsys, folder):
    fifo = _source("fifo", folder)
    (folder / "text.txt").write_text("some text\n" * 50)
    data = {
        "sources": [{"path": str(folder / "text.txt"), "weight": 1.0, "validation": str(fifo)}],
        "seq_len": 32,
        "batch_size": 4,
        "cache_dir": str(folder / "cache"),
    }
    recipe = tiny_recipe(folder, data=data)
    _agree(capsys, recipe, "data.sources.0.validation", fifo, WHAT["fifo"])


def test_a_tokenizer_file_and_init_from_that_are_devices(capsys, folder):
    fifo = _source("fifo", folder)
    recipe = tiny_recipe(folder, tokenizer={"type": "hf", "model_file": str(fifo)})
    _agree(capsys, recipe, "tokenizer.model_file", fifo, WHAT["fifo"])
    spec = yaml.safe_load(recipe.read_text())["model"]["spec"]
    recipe = tiny_recipe(folder, model={"spec": spec, "init_from": str(fifo)})
    _agree(capsys, recipe, "model.init_from", fifo, WHAT["fifo"])


def test_a_fifo_inside_a_folder_of_sources_is_passed_over_and_opening_one_never_blocks(capsys, folder):
    """A folder is walked for its regular files (a FIFO in it is no file of the corpus); a reader
    handed a FIFO by another way (``builder tokenize``, instruction records) refuses it unopened."""
    from yamlformer.recipes.data.instructions import read_records
    from yamlformer.recipes.errors import RecipeError

    fifo = _source("fifo", folder)
    with pytest.raises(RecipeError, match="is a FIFO"):
        next(read_records(fifo.rename(folder / "records.jsonl")))
    bounded_run(capsys, ["tokenize", folder / "records.jsonl", "--out", folder / "out"])
    assert not (folder / "out").exists()
