"""A SLURM job's requeue after its warning signal, asked by the run itself.

SLURM sends ``SIGUSR1`` ahead of a time limit when the job asked for it (``#SBATCH
--signal=USR1@120``); every rank saves ``last.ckpt`` at the same step boundary
(:mod:`yamlformer.recipes.training.signals`; also after a warning that came as the run started,
at its first step) and then global rank 0 requeues the job
(``scontrol requeue $SLURM_JOB_ID``), before any rank exits: the requeued job runs the same
command, which resumes from that checkpoint. The batch script does not read ``srun``'s exit
status to decide: with ``srun --kill-on-bad-exit=1`` the first rank to exit 138 gets the others
killed, so srun's status was 138 or 143 by which rank exited first, and the job was requeued one
time in three. A job submitted with ``--no-requeue`` is refused by ``scontrol`` and the line says so.
Torch-free.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from yamlformer.recipes.training.signals import WARNING


def slurm_job() -> str | None:
    """The id of the SLURM batch job this process is a task of, or None (not under SLURM)."""
    job = os.environ.get("SLURM_JOB_ID")
    return job if job and "SLURM_NTASKS" in os.environ else None


def requeue(signum: int) -> str | None:
    """Requeue this SLURM job after ``signum`` stopped its run: what happened, for the stop's line
    (``None``: not SLURM's warning, or not a SLURM job: nothing to do). Called on global rank 0
    once the checkpoint is written."""
    job = slurm_job()
    if WARNING is None or signum != WARNING or job is None:
        return None
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"SLURM job {job} was not requeued: no scontrol on PATH; resubmit it to resume"
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"SLURM job {job} was not requeued: scontrol requeue {job}: {exc}; resubmit it to resume"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        return f"SLURM job {job} was not requeued ({why}); resubmit it to resume"
    return f"SLURM job {job} requeued: it resumes from it"
