"""``TokenizedDataset.open`` refuses what it cannot trust: a truncated or damaged shard (a
flipped bit, on a first open and after a change), another tokenizer or format version; a second
open reads no shard, and a stamp that cannot be written is skipped."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from tokenize_helpers import docs, sp  # noqa: F401 (sp: a fixture)

from yamlformer.recipes.data.sources import Document
from yamlformer.recipes.data.tokenize import tokenize_documents
from yamlformer.recipes.data.tokenized import TokenizedDataset
from yamlformer.recipes.errors import RecipeError

# -- the reader refuses what it cannot trust ------------------------------------------------------------


@pytest.fixture
def made(tmp_path, sp):
    tokenizer, _ = sp
    tokenize_documents([Document(t) for t in docs(200)], tokenizer, tmp_path / "ds", shard_bytes=4000, progress=False)
    return tmp_path / "ds"


def _first_shard(folder: Path) -> Path:
    return folder / json.loads((folder / "manifest.json").read_text())["splits"]["train"]["shards"][1]["tokens"]


def test_a_truncated_shard_is_refused(made):
    shard = _first_shard(made)
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(RecipeError, match=rf"{shard}: [\d,]+ bytes, the manifest says [\d,]+ \(truncated"):
        TokenizedDataset.open(made)


def test_a_flipped_bit_is_refused_on_a_first_open_and_after_a_change(made):
    shard = _first_shard(made)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    for stamp in made.glob(".verified-*.json"):  # a machine that has not opened it yet
        stamp.unlink()
    shard.write_bytes(bytes(data))
    with pytest.raises(
        RecipeError,
        match=rf"{shard}: sha256 \w+\.\.\., the manifest says \w+\.\.\. \(the file is "
        "damaged\\)",
    ):
        TokenizedDataset.open(made)


def test_a_second_open_reads_no_shard(made, monkeypatch):
    from yamlformer.recipes.data import tokenized

    for stamp in made.glob(".verified-*.json"):
        stamp.unlink()
    TokenizedDataset.open(made)  # verifies and stamps
    monkeypatch.setattr(tokenized, "file_sha256", lambda *a: pytest.fail("a stamped shard was read again"))
    TokenizedDataset.open(made)
    shard = _first_shard(made)
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: verified again
    with pytest.raises(pytest.fail.Exception):
        TokenizedDataset.open(made)


def test_a_stamp_that_cannot_be_written_is_skipped(made):
    """(as in a read-only folder; a folder where the stamp should be fails the same way for root)"""
    (stamp,) = made.glob(".verified-*.json")
    stamp.unlink()
    stamp.mkdir()
    assert TokenizedDataset.open(made).tokens("train") > 0
    assert TokenizedDataset.open(made).tokens("train") > 0


def test_another_tokenizer_version_or_format_is_refused(made):
    manifest = json.loads((made / "manifest.json").read_text())
    fingerprint = manifest["tokenizer"]["fingerprint"]
    with pytest.raises(RecipeError, match=f"{made} was tokenized with tokenizer {fingerprint}, this run's is abc"):
        TokenizedDataset.open(made, tokenizer_fingerprint="abc")
    assert TokenizedDataset.open(made, tokenizer_fingerprint=fingerprint).tokens("train") > 0
    (made / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(RecipeError, match="manifest.json: version 2; this builder reads version 1"):
        TokenizedDataset.open(made)
    (made / "manifest.json").write_text(json.dumps({**manifest, "format": "other"}))
    with pytest.raises(RecipeError, match="format 'other', not 'builder-tokenized'"):
        TokenizedDataset.open(made)
