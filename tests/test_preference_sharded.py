"""``task: preference`` under the sharded strategies, on two CPU processes over gloo: FSDP2 with a
frozen reference sharded like the policy, FSDP2 with adapters (the reference: the policy with its
adapters switched off) and tensor parallelism train as one process does at the same global batch,
step for step, and score the held-out pairs alike at the end. Each run is bounded: a rank that
waits on a collective the other never reaches (a validation batch one rank alone had) is killed,
and the test fails, instead of hanging. Slow: two training processes each (``pytest -m slow``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from recipe_helpers import builder_process
from sharded_helpers import assert_same_losses, losses
from test_preference import _pairs_file, _recipe

#: the longest a two-process run of these tiny models may take on a loaded machine
TIMEOUT = 420

#: 40 pairs, 8 held out, one pair a row: every held-out row is scored once by one process of 4
#: rows a batch and by two of 2, so their validation and end-of-run scores are comparable too
ROWS = {"packing": False, "val_fraction": 0.2}
TRAINER = {"max_steps": 6, "val_check_interval": 3, "checkpoint_every_n_steps": 3, "limit_val_batches": 4}


def _train(path: Path) -> str:
    """``builder train PATH`` in its own process group, killed whole past :data:`TIMEOUT`."""
    child = builder_process(
        "train", str(path), "--no-samples", cwd=path.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        pytest.fail(f"the run did not end in {TIMEOUT} s (a hang): {out.decode(errors='replace')[-3000:]}")
    text = out.decode(errors="replace")
    assert child.returncode == 0, text[-4000:]
    return text


def _run(folder: Path, devices: int, batch: int, **sections) -> tuple[dict, list[float]]:
    trainer = {**TRAINER, "devices": devices, **sections.pop("trainer", {})}
    path = _recipe(folder, data={**ROWS, "batch_size": batch}, trainer=trainer, **sections)
    _pairs_file(folder, n=40)  # over the recipe's 48, before the run reads them
    line = [s for s in _train(path).splitlines() if s.startswith("held out")][-1]  # the end's
    end = [float(re.search(rf"{key} (?:-?[\d.]+%? -> )?(-?[\d.]+)", line)[1]) for key in ("accuracy", "margin", "loss")]
    return losses(folder / "run"), end


CONSTANT = {"type": "constant", "warmup_steps": 2}
LORA = {"type": "lora", "rank": 4, "alpha": 8, "targets": "all-linear"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, adapters",
    [({"strategy": "fsdp"}, None), ({"strategy": "fsdp"}, LORA), ({"strategy": "fsdp", "tensor_parallel": 2}, None)],
    ids=["fsdp-frozen-copy", "fsdp-adapters-off", "tensor-parallel"],
)
def test_two_processes_train_dpo_as_one(layout, adapters, tmp_path):
    model = {} if adapters is None else {"model": {"adapters": adapters}}
    one, one_end = _run(tmp_path / "one", 1, 4, schedule=CONSTANT, **model)
    batch = 4 if layout.get("tensor_parallel") else 2  # a tensor-parallel pair of ranks reads one batch
    two, two_end = _run(tmp_path / "two", 2, batch, schedule=CONSTANT, trainer=layout, **model)
    assert_same_losses(two, one)
    assert two_end == pytest.approx(one_end, abs=2e-4)
