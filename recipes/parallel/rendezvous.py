"""Where a run's processes meet: the rendezvous port of a single-node run, and the process group
a run leaves behind.

Lightning picks ``MASTER_PORT`` by binding port 0 and closing the socket: the kernel hands out a
port from its *ephemeral* range, the one it also gives every outgoing connection, and rank 0's
store binds it again only seconds later, after the other ranks have started. Any connection
opened in between (another run's gloo ranks, a package download) can take it, and the run dies
at start with ``EADDRINUSE``. A port below the ephemeral range is never handed out implicitly, so
only another listener can hold it, which :func:`free_port` checks.

Under SLURM every task is started by ``srun`` and none of them may pick a port of its own (each
would pick a different one and wait for the others at it until the job's time limit): every task
derives the same port from the job's id (:func:`slurm_port`), as Lightning would, but below the
ephemeral range like the others.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

#: Linux's default ephemeral range, where ``/proc`` does not say
EPHEMERAL = (32768, 60999)
#: the lowest port tried: above the registered services most machines run
LOWEST = 20000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicitly bound ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return EPHEMERAL


def bindable(port: int) -> bool:
    """Whether nothing listens on ``port`` (of any local address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds it
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64) -> int | None:
    """A bindable port below the ephemeral range, or None (then Lightning picks one)."""
    low, high = ephemeral_range()
    span = (LOWEST, low) if low - LOWEST >= 1000 else (high + 1, 65535)
    if span[1] - span[0] < 1000:
        return None
    for port in random.SystemRandom().sample(range(*span), tries):
        if bindable(port):
            return port
    return None


def slurm_port(job_id: int) -> int:
    """The port every task of SLURM job ``job_id`` meets at: the same in each task, below the
    ephemeral range (or above it where that leaves no room), different for jobs whose ids differ
    by less than the span."""
    low, high = ephemeral_range()
    span = (LOWEST, low) if low - LOWEST >= 1000 else (high + 1, 65536)
    return span[0] + job_id % (span[1] - span[0])


def under_slurm(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Lightning runs this process (or one with ``environ``) as a task of a SLURM job
    (``srun``; a job named ``bash`` or ``interactive`` is Lightning's way to opt out)."""
    env = os.environ if environ is None else environ
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def choose_main_port(num_nodes: int, processes: int) -> None:
    """Set ``MASTER_PORT`` for a run that has none: under SLURM the port derived from the job
    (:func:`slurm_port`, the same in every task); else for a single-node run of several processes
    a free one (the ranks Lightning starts inherit it). torchrun, or the user, set it otherwise."""
    if "MASTER_PORT" in os.environ:
        return
    if under_slurm():
        with contextlib.suppress(KeyError, ValueError):
            os.environ["MASTER_PORT"] = str(slurm_port(int(os.environ["SLURM_JOB_ID"])))
        return
    if num_nodes != 1 or processes < 2:
        return
    port = free_port()
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)


#: the variables a launcher (Lightning's, torchrun, SLURM's) sets for the ranks to meet
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def run_process_group(num_nodes: int, processes: int):
    """A run's rendezvous, from its start to its end. A single-node run of several processes gets
    its port (:func:`choose_main_port`) before Lightning starts the other ranks. A run of one
    process in a longer-lived Python (a study, a notebook, a test) leaves no process group and no
    rendezvous variables behind: Lightning starts a process group for ``strategy: fsdp`` even on
    one device, with its store listening on ``MASTER_PORT``, and sets that variable in this
    process, so every later run or child process took the port from it and found it taken
    (``EADDRINUSE``). A run of several processes is left as it is: its processes end with it, and
    tearing a group down while another rank may still be in a collective could hang it."""
    before = {name: os.environ.get(name) for name in RENDEZVOUS_ENV}
    choose_main_port(num_nodes, processes)
    ours = not (dist.is_available() and dist.is_initialized())
    try:
        yield
    finally:
        if ours and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
            dist.destroy_process_group()
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
