"""The code is as ``ruff`` (configured in pyproject.toml) formats and lints it: ``ruff format`` and
``ruff check`` change nothing. Run them yourself, or ``pre-commit install`` once."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from data_helpers import REPO


def _ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("command", [["format", "--check", "--quiet"], ["check", "--quiet"]], ids=["format", "lint"])
def test_ruff_changes_nothing(command):
    run = subprocess.run([*_ruff(), *command, "."], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
