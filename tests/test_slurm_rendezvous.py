"""Under SLURM every task meets at the port derived from the job (never one of its own), and only
SLURM's warning signal in a SLURM job asks for a requeue. The real scheduler's runs of these:
tests/slurm_helpers.py."""

from __future__ import annotations

import os
import signal

from yamlformer.recipes.parallel.rendezvous import choose_main_port, ephemeral_range, slurm_port
from yamlformer.recipes.training.requeue import requeue


def test_every_task_of_a_slurm_job_derives_the_same_port(monkeypatch):
    low, _ = ephemeral_range()
    assert slurm_port(4242) == slurm_port(4242) != slurm_port(4243)
    assert slurm_port(4242) < low or low < 21000
    ports = set()
    for task in range(2):  # two tasks of one job on one node, as `srun -N1 -n2` starts them
        monkeypatch.delenv("MASTER_PORT", raising=False)
        for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": str(task)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("SLURM_JOB_NAME", "train")
        choose_main_port(num_nodes=1, processes=2)
        ports.add(os.environ["MASTER_PORT"])
    assert ports == {str(slurm_port(4242))}


def test_only_slurms_warning_in_a_slurm_job_requeues(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue(signal.SIGUSR1) is None  # not a SLURM job
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert requeue(signal.SIGTERM) is None  # scancel: the user stops it
    monkeypatch.setenv("PATH", "/nonexistent")
    assert requeue(signal.SIGUSR1) == "SLURM job 7 was not requeued: no scontrol on PATH; resubmit it to resume"
