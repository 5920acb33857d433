"""Multi-process runs for the sharded-training tests: CPU processes on gloo, tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from recipe_helpers import builder_process, tiny_recipe

#: a constant learning rate, so a run stopped at step N and resumed to M sees the schedule an
#: unbroken run to M does
CONSTANT = {"type": "constant", "warmup_steps": 2}
STEPS = 20


#: a tokenizer whose vocabulary a tensor-parallel degree of 2 divides (the char table of the tiny
#: corpus is 94 symbols and end-of-text: 95, which the vocab-parallel embedding cannot split); a
#: run compared with a tensor-parallel one must use it too
EVEN_VOCAB = {"type": "sentencepiece", "model_type": "bpe", "vocab_size": 400}


def end_process_group() -> None:
    """Leave a spawned worker's process group: a barrier, then ``destroy_process_group``. Gloo's
    worker threads release a finished collective's tensors after its caller has seen it complete;
    a process that then exits at once can finalize the interpreter while one of them still drops a
    tensor Python owns, whose GIL acquire then aborts the process (SIGABRT, "terminate called
    without an active exception", from ``ProcessGroupGloo::runLoop``; about 1 run in 20 of the
    context-parallel model test). The barrier waits for every earlier collective and its round
    trip to the other ranks outlasts that release."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


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
    from yamlformer.builder.checkpoints import read_meta

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


# -- a training child stopped inside a save ----------------------------------------------------------

#: the ``sitecustomize`` of a child started by :func:`train_paused_in_save`: each of its ranks, in
#: its ``AT``-th sharded save, once its shards and their checksums are in the temp folder (before
#: the ranks' barrier, rank 0's ``meta.pt`` and the rename), writes its process id to
#: ``SIGNALS/saving-RANK`` and waits for ``SIGNALS/go``: a kill then lands mid-save however loaded
#: the machine is (a test polling for the temp folder missed saves that took milliseconds)
_PAUSE = """
import os
import time
from pathlib import Path

import yamlformer.builder.checkpoints.write as _write

SIGNALS, AT, _real, _saves = Path({signals!r}), {at}, _write.write_digests, [0]


def _pausing(folder, rank):
    _real(folder, rank)
    _saves[0] += 1
    if _saves[0] == AT:
        said = SIGNALS / f".saving-{{rank}}"
        said.write_text(str(os.getpid()))
        os.replace(said, SIGNALS / f"saving-{{rank}}")  # whole when the test sees it
        deadline = time.monotonic() + 600
        while not (SIGNALS / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


_write.write_digests = _pausing
"""


def train_paused_in_save(path: Path, at: int, ranks: int, log) -> tuple[subprocess.Popen, list[int], Path]:
    """``builder train PATH --no-samples`` in a child whose ``ranks`` processes all stop inside
    their ``at``-th save (:data:`_PAUSE`), its output to the file ``log``; returns once they all
    have: the child, the ranks' process ids (by rank) and the folder where
    touching ``go`` lets them go on."""
    signals = path.parent / "pause"
    (signals / "hook").mkdir(parents=True)
    (signals / "hook" / "sitecustomize.py").write_text(_PAUSE.format(signals=str(signals), at=at))
    paths = [str(signals / "hook"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    command = [sys.executable, "-m", "yamlformer.builder.cli", "train", str(path), "--no-samples"]
    child = subprocess.Popen(command, cwd=path.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while len(list(signals.glob("saving-*"))) < ranks:
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(f"the ranks did not reach save {at}: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.05)
    return child, [int((signals / f"saving-{rank}").read_text()) for rank in range(ranks)], signals
