"""Runs under a real SLURM (the ``slurm`` fixture: tests/slurm_helpers.py, two slurmd on this host):
one node x two tasks meets at one port and trains, and a pre-empted job saves, requeues itself and
resumes with the losses of an unbroken run, whichever rank exits first. ``python -m pytest -m launch``.

Each job is the batch file ``yamlformer.builder.analysis.sbatch`` writes (the one ``builder plan
--sbatch`` prints), running ``builder train`` on CPU ranks (gloo) under ``srun``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from recipe_helpers import assert_same_run, history, tiny_recipe

from yamlformer.builder.analysis.sbatch import sbatch_script
from yamlformer.recipes.parallel.rendezvous import slurm_port

pytestmark = pytest.mark.launch

#: the run every job here trains: DDP on two CPU ranks, a loss logged at every step
TRAINER = {
    "max_steps": 30,
    "val_check_interval": 10,
    "limit_val_batches": 2,
    "checkpoint_every_n_steps": 10,
    "log_every_n_steps": 1,
    "devices": 2,
    "strategy": "ddp",
}
#: seconds a pre-empted job's first attempt sleeps per step, so that the warning lands mid-run
SLOW_STEP = 0.4
JOB_TIMEOUT = 240

# Slows the first attempt's steps (SLURM_RESTART_COUNT is set in a requeued job), marks each step
# reached, and delays the exit of the rank named, so that the other one exits first.
_HOOK = """\
import atexit, os, time
from pathlib import Path
if os.environ.get("SLURM_JOB_ID"):
    import yamlformer.recipes.training.signals as signals
    marks, rank = Path({marks!r}), os.environ.get("SLURM_PROCID", "0")
    steps = signals.StopOnSignal.on_train_batch_end
    def slowed(self, trainer, *args, **kwargs):
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep({delay})
            (marks / f"step-{{trainer.global_step}}-{{rank}}").touch()
        return steps(self, trainer, *args, **kwargs)
    signals.StopOnSignal.on_train_batch_end = slowed
    if rank == {late!r}:
        atexit.register(time.sleep, 3)
"""


def submit(slurm, folder: Path, recipe: Path, env=None, flags=(), warning: int = 60) -> int:
    """Submit the batch file of ``builder train RECIPE`` on one node x two tasks from ``folder``
    (SLURM's warning ``warning`` seconds before the time limit); the job id."""
    command = f"python -m yamlformer.builder.cli train {recipe} --no-samples"
    script = folder / "job.sbatch"
    script.write_text(
        sbatch_script(command, nodes=1, tasks_per_node=2, gpus_per_node=None, activate="", warning_seconds=warning)
    )
    return slurm.submit(script, *flags, env=env)


def job_log(folder: Path, job: int) -> str:
    log = folder / f"yamlformer-{job}.out"
    return log.read_text(errors="replace") if log.exists() else ""


def recipe_in(folder: Path, cache: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_recipe(
        folder,
        data={"batch_size": 2, "cache_dir": str(cache)},
        trainer={**TRAINER, "output_dir": str(folder / "run")},
    )


@pytest.fixture(scope="session")
def unbroken(slurm, tmp_path_factory):
    """One node x two tasks (``srun -N1 -n2``, ``devices: 2``) trained to the end: its folder,
    job id, seconds from submission to the end, and log."""
    folder = tmp_path_factory.mktemp("unbroken")
    recipe = recipe_in(folder, tmp_path_factory.getbasetemp() / "slurm-cache")
    started = time.monotonic()
    job = submit(slurm, folder, recipe)
    fields = slurm.finished(job, JOB_TIMEOUT)
    return folder, job, time.monotonic() - started, fields, job_log(folder, job)


def test_one_node_two_tasks_meet_at_the_jobs_port_and_train(unbroken):
    """Both tasks start on an empty ``data.cache_dir`` (the session's first job): one tokenizes,
    the other waits for it and reads the same dataset (``recipes/data/dataset_folder.py``'s lock)."""
    folder, job, seconds, fields, log = unbroken
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert len(list((folder.parent / "slurm-cache" / "tokenized").iterdir())) == 1
    assert "GLOBAL_RANK: 1" in log or "MEMBER: 2/2" in log, log[-3000:]
    assert (folder / "run" / "checkpoints" / "last.ckpt").exists()
    print(f"srun -N1 -n2, 30 steps: {seconds:.1f} s from submission; port {slurm_port(job)}")


def _stop_step(log: str) -> int:
    found = re.findall(r"stopped by SIGUSR1 at step (\d+); saved \S+; SLURM job \d+ requeued", log)
    assert found, log[-3000:]
    return int(found[0])


#: how the warning comes: ``scancel --signal=USR1`` once the first attempt reached step 5, or
#: ``--signal=USR1@45`` of a two-minute ``--time``. SLURM's timer ticks every 30 s and sends the
#: warning at the first tick within 30 s of the time it asked for: 45 to 75 s into each attempt.
#: The first attempt, slowed to 3 s a step, is training then; the requeued one ends in under 45 s.
WAYS = {"scancel": ((), 60, SLOW_STEP), "time-limit": (("--time=2",), 45, 3.0)}


@pytest.mark.parametrize(
    "way,late",
    [
        ("scancel", "0"),
        ("scancel", "1"),
        # slow: 3 of 5 here; in the other 2 SLURM 22.05 signalled the requeued attempt as it started,
        # before Python had its handler, and the job failed (`pytest -m "launch and slow"`)
        pytest.param("time-limit", "1", marks=pytest.mark.slow),
    ],
    ids=["scancel-rank-1-exits-first", "scancel-rank-0-exits-first", "time-limit"],
)
def test_a_usr1_mid_run_saves_requeues_and_resumes_like_the_unbroken_run(slurm, unbroken, tmp_path, way, late):
    flags, warning, delay = WAYS[way]
    folder = tmp_path / "job"
    recipe = recipe_in(folder, unbroken[0].parent / "slurm-cache")
    marks = tmp_path / "marks"
    (marks / "hook").mkdir(parents=True)
    (marks / "hook" / "sitecustomize.py").write_text(_HOOK.format(marks=str(marks), delay=delay, late=late))
    started = time.monotonic()
    job = submit(slurm, folder, recipe, env=slurm.job_env(marks / "hook"), flags=flags, warning=warning)
    deadline = time.monotonic() + JOB_TIMEOUT
    while way == "scancel" and not (marks / "step-5-0").exists():
        running = slurm.job(job)["JobState"] in ("PENDING", "RUNNING")
        assert time.monotonic() < deadline and running, job_log(folder, job)[-3000:]
        time.sleep(0.2)
    if way == "scancel":
        slurm.run("scancel", "--signal=USR1", str(job))
    slurm.requeued(job, JOB_TIMEOUT)
    fields = slurm.finished(job, JOB_TIMEOUT)
    seconds = time.monotonic() - started
    log = job_log(folder, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log[-3000:]
    step = _stop_step(log)
    assert 0 < step < TRAINER["max_steps"], log[-3000:]
    assert f"resuming from {folder / 'run' / 'checkpoints' / 'last.ckpt'}" in log, log[-3000:]
    last, reference = folder / "run" / "checkpoints" / "last.ckpt", unbroken[0] / "run" / "checkpoints" / "last.ckpt"
    assert_same_run(last, reference)
    after = [(s, x, y) for (s, x), (_, y) in zip(history(last)["train"], history(reference)["train"]) if s > step]
    print(
        f"\n{way}, rank {late} exiting last: stopped at step {step}, requeued once, {seconds:.1f} s; "
        "step: requeued / unbroken loss: " + ", ".join(f"{s}: {x:.6f} / {y:.6f}" for s, x, y in after[:5])
    )
