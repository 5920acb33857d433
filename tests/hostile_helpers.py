"""Running the command line in-process as a hostile user would, and judging what it printed.

:func:`cli` calls ``builder.cli.main`` and returns its exit status with what it wrote;
:func:`refused` asserts that a refusal is what every refusal must be: the expected exit status,
one line on stderr that names the field or option, no traceback, and never the last-resort
"internal error" (every case has its own message: a test that reached the net has found a bug).
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

import pytest
from recipe_helpers import TINY_SPEC  # the spec tiny_recipe trains: its checkpoints below hold it

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Result:
    status: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def cli(capsys, *argv: str) -> Result:
    """``builder ARGV`` in this process: its exit status (argparse's ``SystemExit`` too) and output."""
    from builder.cli import main

    capsys.readouterr()
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: --help, or a malformed command line (2)
        status = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return Result(status, captured.out, captured.err)


def clean(result: Result) -> None:
    """Nothing a user should never see: a traceback, the last-resort net, Python's own error names."""
    text = result.text
    assert "Traceback" not in text, text
    assert "internal error" not in text, text
    for name in (
        "RecursionError",
        "IndexError",
        "AttributeError",
        "KeyError",
        "TypeError:",
        "ZeroDivisionError",
        "OverflowError",
        "MemoryError",
        "weights_only=False",
        "weights_only` set to `False",
    ):
        assert name not in text, text


def refused(result: Result, status: int, *needles: str, lines: int = 1) -> str:
    """Assert a clean refusal with ``status`` whose stderr holds every needle; returns stderr."""
    clean(result)
    assert result.status == status, (result.status, result.text)
    err = result.err.strip()
    assert err, result.out
    assert len(err.splitlines()) <= lines, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def lm_checkpoint(folder: Path) -> Path:
    """An untrained language-model checkpoint as ``builder train`` writes it (its metadata, the
    LightningModule's state dict, sealed when checksums exist), with a char tokenizer over the
    printable ASCII characters; in well under a second."""
    import torch
    from recipe_helpers import tiny_recipe

    from builder.assemble import build_model
    from builder.spec.schema import spec_model
    from recipes.data.tokenizers import CharTokenizer
    from recipes.recipe.sections import load_recipe
    from recipes.training.run import training_meta

    folder.mkdir(parents=True, exist_ok=True)
    recipe_file = tiny_recipe(folder)
    recipe = load_recipe(recipe_file)
    tokenizer = CharTokenizer(sorted(set(string.printable)))
    spec = spec_model().model_validate({**TINY_SPEC, "vocab_size": tokenizer.vocab_size})
    torch.manual_seed(0)
    model = build_model(spec)
    checkpoint = {
        "builder": training_meta(recipe, recipe_file, spec, tokenizer, task="lm"),
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 0,
    }
    try:  # checkpoints are sealed with checksums where the project has them
        from builder.checkpoints import seal
    except ImportError:
        pass
    else:
        seal(checkpoint)
    path = folder / "last.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return lm_checkpoint(tmp_path_factory.mktemp("ckpt"))
