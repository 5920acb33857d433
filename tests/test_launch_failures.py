"""What a user meets launching across nodes, each in one line and fast (the launches themselves:
tests/test_torchrun_launch.py, ``pytest -m launch``)."""

from __future__ import annotations

import pytest

from yamlformer.recipes.data.dataset_folder import check_output
from yamlformer.recipes.errors import RecipeError


def test_a_cache_another_node_has_just_started_to_fill_is_not_a_foreign_folder(tmp_path):
    """Two nodes sharing ``data.cache_dir`` start at once: the second sees the first's lock and the
    temp file its settings are written through, and waits for it (it refused the folder)."""
    out = tmp_path / "tokenized" / "abc"
    out.mkdir(parents=True)
    (out / ".lock").write_text("pid 1 on node-0\n")
    (out / ".started.json.tmp-4242").write_bytes(b"{")
    check_output(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="a folder with other files in it"):
        check_output(out)
