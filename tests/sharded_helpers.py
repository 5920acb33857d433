"""Multi-process runs for the sharded-training tests: CPU processes on gloo, tiny models."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from recipe_helpers import builder_process, tiny_recipe

#: a constant learning rate, so a run stopped at step N and resumed to M sees the schedule an
#: unbroken run to M does
CONSTANT = {"type": "constant", "warmup_steps": 2}
STEPS = 20


#: a tokenizer whose vocabulary a tensor-parallel degree of 2 divides (the char table of the tiny
#: corpus is 94 symbols and end-of-text: 95, which the vocab-parallel embedding cannot split)
EVEN_VOCAB = {"type": "sentencepiece", "model_type": "bpe", "vocab_size": 400}


def recipe(
    folder: Path,
    *,
    batch: int,
    devices: int = 1,
    spec: dict | None = None,
    steps: int = STEPS,
    tokenizer: dict | None = None,
    **trainer,
) -> Path:
    """A tiny LM recipe in ``folder`` (its run under ``folder/run``); ``tokenizer`` replaces the char one."""
    folder.mkdir(parents=True, exist_ok=True)
    sections = {
        "data": {"batch_size": batch},
        "schedule": CONSTANT,
        "trainer": {
            "max_steps": steps,
            "val_check_interval": 10,
            "limit_val_batches": 1,
            "checkpoint_every_n_steps": 10,
            "devices": devices,
            "output_dir": str(folder / "run"),
            **trainer,
        },
    }
    if spec is not None:
        sections["model"] = {"spec": spec}
    if tokenizer is not None:
        sections["tokenizer"] = tokenizer
    return tiny_recipe(folder, **sections)


def train(path: Path, *args: str, timeout: int = 900) -> str:
    """``builder train PATH --no-samples ARGS`` in a child process (it launches the other ranks);
    its output, after asserting it succeeded."""
    child = builder_process(
        "train", str(path), "--no-samples", *args, cwd=path.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = child.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert child.returncode == 0, text[-4000:]
    return text


def losses(run_dir: Path) -> dict:
    """``{"train": [(step, loss)...], "val": [...]}`` of a run's ``last.ckpt`` (file or folder); the
    training losses of one optimizer step (several with gradient accumulation) averaged."""
    from builder.checkpoints import read_meta

    history = read_meta(run_dir / "checkpoints" / "last.ckpt")["builder"]["history"]
    by_step: dict[int, list[float]] = {}
    for step, value in history["train"]:
        by_step.setdefault(step, []).append(value)
    return {
        "train": [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())],
        "val": [(v[0], v[1]) for v in history["val"]],
    }


def assert_same_losses(a: dict, b: dict, atol: float = 2e-5, keys=("train", "val")) -> None:
    """Equal losses step for step (``keys``: validation is comparable only between runs whose
    validation batches hold the same windows: the same batch x processes)."""
    assert [s for s, _ in a["train"]] == [s for s, _ in b["train"]], (a["train"], b["train"])
    for key in keys:
        torch.testing.assert_close(
            torch.tensor([x for _, x in a[key]]), torch.tensor([x for _, x in b[key]]), rtol=0, atol=atol
        )
