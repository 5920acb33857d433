"""The SLURM batch file of a launch: one ``srun`` of ``builder train`` that survives pre-emption.

What each line is for:

* ``--signal=USR1@N``: SLURM sends ``SIGUSR1`` to every task N seconds before the time limit (up
  to 30 s earlier, at the tick of its timer); the run saves ``last.ckpt`` at the next step
  boundary (one that comes while the run starts: at its first) and global rank 0 requeues the
  job itself (``yamlformer.recipes.training.requeue``) before any rank exits. The script reads
  no exit status: with ``--kill-on-bad-exit=1`` the first rank to exit gets the others killed,
  so ``srun``'s status was 138 or 143 by which rank ended first, and a script testing ``$? -eq
  138`` lost the requeue two times in three.
* ``--requeue``: the job may be requeued (clusters that default to ``JobRequeue=0`` refuse it).
* ``--open-mode=append``: the requeued job appends to the first attempt's log, which sbatch
  would otherwise truncate.
* ``srun --kill-on-bad-exit=1``: a rank that dies (an error, SIGKILL) ends the job instead of
  leaving the others waiting in a collective; the next submission resumes from the last
  checkpoint.
* the environment's activation, so ``builder`` is found on every node; ``--gres`` is left out for
  a cluster of CPU nodes (``gpus_per_node=None``).

Torch-free.
"""

from __future__ import annotations

import os
import shlex
import sys

#: seconds before the time limit that SLURM sends its warning (saving a checkpoint fits in it)
WARNING_SECONDS = 120


def activation() -> str:
    """The line that activates the Python environment this process runs in, for a batch script:
    a virtual environment's ``activate``, a conda environment's ``conda activate``, else its
    ``bin`` folder put first on ``PATH``."""
    if sys.prefix != sys.base_prefix and os.path.isfile(os.path.join(sys.prefix, "bin", "activate")):
        return f". {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"
    conda = os.environ.get("CONDA_PREFIX")
    if conda and os.path.realpath(conda) == os.path.realpath(sys.prefix):
        return f"conda activate {shlex.quote(conda)}"
    return f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"'


def sbatch_script(
    command: str,
    *,
    nodes: int,
    tasks_per_node: int,
    gpus_per_node: int | None,
    activate: str | None = None,
    job_name: str = "yamlformer",
    warning_seconds: int = WARNING_SECONDS,
) -> str:
    """The batch file that runs ``command`` (``builder train ...``) as ``nodes`` x ``tasks_per_node``
    tasks, one per GPU (``gpus_per_node``; ``None``: CPU nodes, no ``--gres``), after
    ``activate`` (default :func:`activation`)."""
    if warning_seconds < 1:
        raise ValueError(f"warning_seconds {warning_seconds}: must be at least 1")

    def noted(line: str, note: str) -> str:
        return f"{line:<34} # {note}"

    gres = [noted(f"#SBATCH --gres=gpu:{gpus_per_node}", "one GPU per task (builder plan --no-gres: CPU nodes)")]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
        *(gres if gpus_per_node else []),
        noted(f"#SBATCH --signal=USR1@{warning_seconds}", "before the time limit: save at the next step, requeue"),
        "#SBATCH --requeue",
        noted("#SBATCH --open-mode=append", "a requeued job appends to the first attempt's log"),
        "#SBATCH --output=%x-%j.out",
        "# rank 0 requeues the job itself once last.ckpt is written (the requeued job resumes from it):",
        "# nothing here reads srun's exit status, which depends on which rank exited first",
        activate if activate is not None else activation(),
        f"srun --kill-on-bad-exit=1 {command}",
    ]
    return "\n".join(lines) + "\n"
