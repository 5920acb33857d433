"""Running the command line in-process as a hostile user would, and judging what it printed.

:func:`cli` calls ``yamlformer.builder.cli.main`` and returns its exit status with what it wrote;
:func:`refused` asserts that a refusal is what every refusal must be: the expected exit status,
one line on stderr that names the field or option, no traceback, and never the last-resort
"internal error" (every case has its own message: a test that reached the net has found a bug);
:func:`bounded_run` runs one command as the fuzz tests do, bounded in time and memory.
"""

from __future__ import annotations

import dataclasses
import signal
import string
import time
from pathlib import Path
from types import SimpleNamespace

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
    from yamlformer.builder.cli import main

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

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.data.tokenizers import CharTokenizer
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import training_meta

    folder.mkdir(parents=True, exist_ok=True)
    recipe_file = tiny_recipe(folder)
    recipe = load_recipe(recipe_file).recipe
    tokenizer = CharTokenizer(sorted(set(string.printable)))
    spec = spec_model().model_validate({**TINY_SPEC, "vocab_size": tokenizer.vocab_size})
    torch.manual_seed(0)
    model = build_model(spec)
    checkpoint = {
        "builder": training_meta(
            SimpleNamespace(recipe=recipe, file=recipe_file, spec=spec, source=None), tokenizer, task="lm"
        ),
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 0,
    }
    try:  # checkpoints are sealed with checksums where the project has them
        from yamlformer.builder.checkpoints import seal
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


# -- one command, bounded (the fuzz tests') ---------------------------------------------------------

#: a command that runs longer than this is taken for a hang (CI's shared CPUs are slow)
SECONDS = 15.0
#: the most a command may raise the process's peak resident memory
MEGABYTES = 400
STATUSES = {0, 1, 2}


class _Hung(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` on the way swallows it."""


def _rss_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def bounded_run(capsys, argv: list) -> None:
    """``builder ARGV`` in this process: a documented status, no traceback, bounded time and memory."""
    import resource

    resettable = _reset_peak()
    before = _rss_mb("VmRSS") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def alarm(signum, frame):
        raise _Hung

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    start = time.perf_counter()
    try:
        result = cli(capsys, *argv)
    except _Hung:
        pytest.fail(f"builder {' '.join(map(str, argv))!r} ran more than {SECONDS} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - start
    peak = _rss_mb("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shown = f"builder {' '.join(map(repr, map(str, argv)))}: status {result.status}\n{result.text[-2000:]}"
    clean(result)
    assert result.status in STATUSES, shown
    assert seconds < SECONDS, shown
    if peak is not None and before is not None:
        assert peak - before < MEGABYTES, f"{shown}\npeak memory grew by {peak - before:.0f} MB"
