"""The attention tuning cache (``attention-tuning.json``) is a file anyone may have damaged: every
shape it can hold that is not the cache's mapping of mappings counts as empty, a FIFO or a folder
in its place is not opened (reading a FIFO blocks for ever), and a choice written over it keeps
only what is well formed. (A cached config is only taken when it is one of the table's candidates:
``choose`` asks ``cached in pool``.) Found by ``benchmarks/hostile_run.py``: a fingerprint holding a
string raised AttributeError on every Triton attention call."""

from __future__ import annotations

import json
import os

import pytest

from yamlformer.kernels import tuning


@pytest.fixture(autouse=True)
def _fingerprint(monkeypatch):
    monkeypatch.setattr(tuning, "fingerprint", lambda: "fp")  # Triton's version, on a GPU


@pytest.mark.parametrize(
    "text",
    [
        "{ not json",
        "[1, 2]",
        json.dumps({"fp": "x"}),
        json.dumps({"fp": {"gpu": [1]}}),
        json.dumps({"fp": {"gpu": {"fwd": 3}}}),
        json.dumps({"fp": {"gpu": {"fwd": {"key": "BLOCK_M"}}}}),
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["not-json", "list", "fingerprint-string", "gpu-list", "kernel-number", "config-string", "deep"],
)
def test_a_damaged_cache_is_empty_and_written_over_whole(tmp_path, text):
    path = tmp_path / "attention-tuning.json"
    path.write_text(text)
    cache = tuning.DiskCache(path)
    assert cache.get("gpu", "fwd", "key") is None
    cache.put("gpu", "fwd", "key2", {"BLOCK_M": 64})
    assert cache.get("gpu", "fwd", "key2") == {"BLOCK_M": 64}
    assert json.loads(path.read_text()) == {"fp": {"gpu": {"fwd": {"key2": {"BLOCK_M": 64}}}}}


def test_a_kept_choice_survives_a_damaged_neighbour(tmp_path):
    path = tmp_path / "attention-tuning.json"
    path.write_text(json.dumps({"fp": {"gpu": {"fwd": {"a": {"BLOCK_M": 32}}, "dq": 7}, "other": "x"}, "old": {}}))
    tuning.DiskCache(path).put("gpu", "fwd", "b", {"BLOCK_M": 64})
    assert json.loads(path.read_text()) == {
        "fp": {"gpu": {"fwd": {"a": {"BLOCK_M": 32}, "b": {"BLOCK_M": 64}}, "dq": {}}}
    }


def test_a_fifo_or_a_folder_in_its_place_is_not_opened(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: reading it would block for ever
    assert tuning.DiskCache(fifo).get("gpu", "fwd", "key") is None
    folder = tmp_path / "folder.json"
    folder.mkdir()
    cache = tuning.DiskCache(folder)
    assert cache.get("gpu", "fwd", "key") is None
    cache.put("gpu", "fwd", "key", {"BLOCK_M": 64})  # cannot replace a folder: kept in memory only
    assert folder.is_dir()
