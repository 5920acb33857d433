"""Our generic top-level names: a foreign package of the same name is named in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    """``python -m builder.cli`` from the spec folder's parent, importing from ``pythonpath`` only."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    return subprocess.run(
        [sys.executable, "-m", "builder.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT / "specs"
    )


def test_every_package_of_ours_carries_the_mark():
    from builder.packages import MARK, NAMES, foreign

    for name in NAMES:
        assert MARK in (ROOT / name / "__init__.py").read_text()
    assert foreign() is None


def test_a_foreign_kernels_package_earlier_on_the_path_is_named_in_one_line(tmp_path):
    other = tmp_path / "site"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text('"""Somebody else\'s kernels."""\n')
    done = run_cli("validate", str(ROOT / "specs" / "tiny" / "llama.yaml"), pythonpath=[other, ROOT])
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "the module `kernels` resolves to" in lines[0] and str(other / "kernels") in lines[0]
    assert "pip uninstall" in lines[0]


def test_another_distribution_overwriting_our_init_is_caught(tmp_path):
    """A package installed over ours in the same folder: the folder is right, the files are not."""
    tree = tmp_path / "tree"
    for name in ("builder", "blocks", "kernels", "recipes"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "kernels" / "__init__.py").write_text('"""Another distribution\'s kernels."""\n')
    done = run_cli("describe", "tiny/llama.yaml", pythonpath=[tree])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "`kernels`" in done.stderr and "not transformer-builder's" in done.stderr


def test_the_python_api_raises_an_import_error_with_the_same_line(tmp_path, monkeypatch):
    import builder
    from builder import packages

    monkeypatch.setattr(packages, "foreign", lambda: "the module `blocks` resolves to elsewhere")
    with pytest.raises(ImportError, match="`blocks` resolves to elsewhere"):
        builder.load_spec  # noqa: B018


def test_version():
    import builder

    done = run_cli("--version", pythonpath=[ROOT])
    assert done.returncode == 0
    assert done.stdout.startswith(f"builder {builder.__version__} (torch ")
    assert "lightning" in done.stdout and "triton" in done.stdout
