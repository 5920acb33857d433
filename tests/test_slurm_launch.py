"""Runs under a real SLURM (the ``slurm`` fixture: tests/slurm_helpers.py, two slurmd on this host):
one node x two tasks meets at one port and trains; a pre-empted job (``scancel --signal=USR1`` mid-run
or as its tasks start, SLURM's time-limit warning) saves, requeues itself and resumes with the losses
of an unbroken run, whichever rank exits first; a task killed with SIGKILL ends the job, and the
next submission resumes from the last checkpoint. ``python -m pytest -m launch``.

Each job is the batch file ``yamlformer.builder.analysis.sbatch`` writes (the one ``builder plan
--sbatch`` prints), running ``builder train`` on CPU ranks (gloo) under ``srun``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import slurm_helpers
from recipe_helpers import assert_same_run, history, tiny_recipe

from yamlformer.builder.analysis.sbatch import sbatch_script
from yamlformer.builder.checkpoints import read_checkpoint
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

# Marks each step reached; while the file `slow` is there, slows the steps of a job's first attempt
# (SLURM_RESTART_COUNT is set in a requeued one), and with `slow-torch` its import of torch by 3 s;
# delays the exit of the rank named, so that the other one exits first. The callback is patched once
# it is imported, not here: this runs as the interpreter starts, and loading torch here would hold
# back `builder train`'s signal handlers.
_HOOK = """\
import atexit, importlib.abc, importlib.util, os, sys, time
from pathlib import Path
if os.environ.get("SLURM_JOB_ID"):
    marks, rank = Path({marks!r}), os.environ.get("SLURM_PROCID", "0")
    first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"

    def patch(module):
        steps = module.StopOnSignal.on_train_batch_end
        def slowed(self, trainer, *args, **kwargs):
            if first and (marks / "slow").exists():
                time.sleep({delay})
            (marks / f"step-{{trainer.global_step}}-{{rank}}").touch()
            return steps(self, trainer, *args, **kwargs)
        module.StopOnSignal.on_train_batch_end = slowed

    class Patching(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "yamlformer.recipes.training.stop_on_signal":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module
            def exec_module(module):
                load(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec

    class SlowTorch(importlib.abc.MetaPathFinder):  # torch read from a slow disk: a start-up that lasts
        def find_spec(self, name, path, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                time.sleep(3)
            return None

    sys.meta_path.insert(0, Patching())
    if first and (marks / "slow-torch").exists():
        sys.meta_path.insert(0, SlowTorch())
    if rank == {late!r}:
        atexit.register(time.sleep, 3)
"""


def hooked(folder: Path, delay: float, late: str | None = None) -> Path:
    """A folder of marks with the :data:`_HOOK` that slows steps by ``delay`` (while ``slow`` is
    there) and delays rank ``late``'s exit; the hook's folder is ``marks / "hook"``."""
    marks = folder / "marks"
    (marks / "hook").mkdir(parents=True)
    (marks / "hook" / "sitecustomize.py").write_text(_HOOK.format(marks=str(marks), delay=delay, late=late))
    (marks / "slow").touch()
    return marks


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


#: the line of each attempt stopped by a warning: its step, and whether the warning came before training
STOP = re.compile(
    r"stopped by SIGUSR1 at step (\d+)( \(received before training started\))?; saved \S+; SLURM job \d+ requeued"
)


def _stops(log: str) -> list[tuple[int, bool]]:
    return [(int(step), bool(early)) for step, early in STOP.findall(log)]


def _losses(last: Path, reference: Path, after: int) -> str:
    pairs = zip(history(last)["train"], history(reference)["train"])
    return ", ".join(f"{s}: {x:.6f} / {y:.6f}" for (s, x), (_, y) in pairs if s > after)


def _until(what, timeout: float, slurm, job: int, log) -> None:
    """Poll ``what()`` (every 50 ms) while the job is pending or running; fail with its log's end otherwise."""
    deadline, polls = time.monotonic() + timeout, 0
    while not what():
        if polls % 20 == 0:  # the job's state once a second
            running = slurm.job(job)["JobState"] in ("PENDING", "RUNNING")
            assert time.monotonic() < deadline and running, log()[-3000:]
        polls += 1
        time.sleep(0.05)


def _starting(slurm, job: int) -> bool:
    """Both tasks run ``builder train`` and handle SIGUSR1 (``SigCgt``), and neither has loaded torch."""
    tasks = slurm.tasks(job)
    if len(tasks) < 2 or not all(slurm_helpers.catches(pid, signal.SIGUSR1) for pid in tasks.values()):
        return False
    assert not any(slurm_helpers.loaded(pid, "libtorch") for pid in tasks.values()), "torch loaded before the handler"
    return True


#: how the warning comes: ``scancel --signal=USR1`` once the first attempt reached step 5, or as both
#: tasks start (their handler in place, torch not loaded yet), or ``--signal=USR1@45`` of a two-minute
#: ``--time``. SLURM's timer ticks every 30 s and sends the warning at the first tick within 30 s of the
#: time it asked for: 45 to 75 s into each attempt. The first attempt, slowed to 3 s a step, is
#: training then; a requeued one that outlives 45 s (a busy machine) is warned too, and each
#: warning, also one that comes as an attempt starts, saves at the next step and requeues again.
WAYS = {
    "scancel": ((), 60, SLOW_STEP),
    "scancel-at-start": ((), 60, SLOW_STEP),
    "time-limit": (("--time=2",), 45, 3.0),
}


@pytest.mark.parametrize(
    "way,late",
    [
        ("scancel", "0"),
        ("scancel", "1"),
        ("scancel-at-start", "0"),
        # slow: SLURM's timer warns 45 to 75 s into the attempt, 118 s in all (`pytest -m "launch and slow"`)
        pytest.param("time-limit", "1", marks=pytest.mark.slow),
    ],
    ids=["scancel-rank-1-exits-first", "scancel-rank-0-exits-first", "scancel-at-start", "time-limit"],
)
def test_a_usr1_saves_requeues_and_resumes_like_the_unbroken_run(slurm, unbroken, tmp_path, way, late):
    flags, warning, delay = WAYS[way]
    folder = tmp_path / "job"
    recipe = recipe_in(folder, unbroken[0].parent / "slurm-cache")
    marks = hooked(tmp_path, delay, late)
    if way == "scancel-at-start":  # the first attempt's start-up outlasts the polls that find it
        (marks / "slow-torch").touch()
    started = time.monotonic()
    job = submit(slurm, folder, recipe, env=slurm.job_env(marks / "hook"), flags=flags, warning=warning)
    if way == "scancel":
        _until((marks / "step-5-0").exists, JOB_TIMEOUT, slurm, job, lambda: job_log(folder, job))
    if way == "scancel-at-start":
        _until(lambda: _starting(slurm, job), JOB_TIMEOUT, slurm, job, lambda: job_log(folder, job))
    if way != "time-limit":
        slurm.run("scancel", "--signal=USR1", str(job))
    fields = slurm.finished(job, 2 * JOB_TIMEOUT, requeues=True)
    seconds = time.monotonic() - started
    log = job_log(folder, job)
    restarts, stops = int(fields["Restarts"]), _stops(log)
    assert fields["JobState"] == "COMPLETED" and restarts >= 1 and len(stops) == restarts, log[-3000:]
    if way != "time-limit":  # one warning: one requeue
        assert restarts == 1, log[-3000:]
    steps = [step for step, _ in stops]
    assert steps[0] > 0 and steps == sorted(set(steps)) and steps[-1] < TRAINER["max_steps"], log[-3000:]
    if way == "scancel-at-start":  # kept through the start, acted on at the first step boundary
        assert stops[0] == (1, True), log[-3000:]
    if way == "scancel":  # sent once step 5 was reached
        assert stops[0][0] >= 5 and not stops[0][1], log[-3000:]
    last, reference = folder / "run" / "checkpoints" / "last.ckpt", unbroken[0] / "run" / "checkpoints" / "last.ckpt"
    assert log.count(f"resuming from {last}") == restarts, log[-3000:]
    assert_same_run(last, reference)
    print(
        f"\n{way}, rank {late} exiting last: stopped at steps {steps} ({sum(e for _, e in stops)} warned before "
        f"training), {restarts} requeue(s), {seconds:.1f} s; step: requeued / unbroken loss: "
        + _losses(last, reference, steps[0])
    )


# rank 0 holds the run folder's lock and writes the checkpoints; rank 1's case is slow (70 s each)
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_rank_killed_with_sigkill_ends_the_job_and_the_next_submission_resumes(slurm, unbroken, tmp_path, rank):
    """``kill -9`` of one task past a periodic checkpoint: ``srun --kill-on-bad-exit=1`` ends the
    job (FAILED, not requeued, not waiting in a collective), the checkpoint is whole, and the
    same batch file submitted again resumes from it to the unbroken run's losses."""
    folder = tmp_path / "job"
    recipe = recipe_in(folder, unbroken[0].parent / "slurm-cache")
    marks = hooked(tmp_path, SLOW_STEP)
    env = slurm.job_env(marks / "hook")
    job = submit(slurm, folder, recipe, env=env)
    last, reference = folder / "run" / "checkpoints" / "last.ckpt", unbroken[0] / "run" / "checkpoints" / "last.ckpt"
    past = [marks / f"step-13-{task}" for task in (0, 1)]  # the checkpoint of step 10 is written
    _until(lambda: all(mark.exists() for mark in past), JOB_TIMEOUT, slurm, job, lambda: job_log(folder, job))
    os.kill(slurm.tasks(job)[rank], signal.SIGKILL)
    killed = time.monotonic()
    ended, log = slurm.finished(job, 120), job_log(folder, job)
    seconds_to_end = time.monotonic() - killed
    assert ended["JobState"] == "FAILED" and ended["Restarts"] == "0", log[-3000:]
    assert read_checkpoint(last)["global_step"] == 10  # read whole: every tensor's checksum holds
    (marks / "slow").unlink()
    started = time.monotonic()
    again = submit(slurm, folder, recipe, env=env)  # the same batch file, submitted again
    fields = slurm.finished(again, JOB_TIMEOUT)
    seconds = time.monotonic() - started
    log = job_log(folder, again)
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert f"resuming from {last}" in log, log[-3000:]
    assert_same_run(last, reference)
    print(
        f"\nrank {rank} killed past step 13: job ended in {seconds_to_end:.1f} s ({ended['JobState']}, exit code "
        f"{ended['ExitCode']}), resumed at 10 "
        f"and finished in {seconds:.1f} s; step: resumed / unbroken loss: " + _losses(last, reference, 10)
    )
