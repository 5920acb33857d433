"""A real SLURM on this host for the launch tests: munged, slurmctld and two slurmd (nodes ``n1``
and ``n2``, both this machine, as Debian's ``slurm-wlm`` can run them: ``slurmd -N n1``), each
from its own folder, configuration and ports, stopped afterwards. ``.ci/run`` installs the
packages (``apt-get install slurm-wlm munge``); where they are missing, or this is not root
(slurmd starts jobs as their users), the tests that ask for :func:`slurm` skip and say why.

The commands (``sbatch``, ``srun``, ``squeue``, ``scontrol``) find this cluster through
``SLURM_CONF``, which :class:`Cluster` puts in the environment it gives them; a job inherits it
(``sbatch`` exports the submitting environment), so ``scontrol requeue`` inside a job reaches the
same controller. The nodes' names must resolve, as a cluster's do (Lightning's ``MASTER_ADDR`` is
the job's first node): where they do not, ``/etc/hosts`` gets one line naming them at 127.0.0.1
while the cluster runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo")
NODES = ("n1", "n2")
CPUS = 2  # per node: one node runs two tasks (1 node x 2 tasks), two nodes one each
#: seconds the cluster may take from the daemons' start to idle nodes
START_TIMEOUT = 60


def missing() -> str | None:
    """Why a SLURM cannot start here, or None."""
    if os.geteuid() != 0:
        return "SLURM tests need root (slurmd starts jobs as their users)"
    absent = [name for name in DAEMONS if _which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing; apt-get install slurm-wlm munge)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running SLURM: its folder, configuration and the environment its commands need."""

    root: Path
    env: dict = field(default_factory=dict)
    processes: list = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster; its output as text."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def sbatch(self, script: Path, *flags: str) -> int:
        """Submit ``script``; its job id."""
        out = self.run("sbatch", "--parsable", *flags, str(script)).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def wait(self, job_id: int, done, timeout: float, every: float = 1.0) -> dict:
        """Poll the job until ``done(fields)``; its last fields. Fails naming the state it was in."""
        deadline = time.monotonic() + timeout
        fields: dict = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if done(fields):
                return fields
            time.sleep(every)
        raise AssertionError(f"job {job_id} still {fields.get('JobState')} after {timeout:.0f}s: {fields}")

    def finished(self, job_id: int, timeout: float, requeues: bool = False) -> dict:
        """Wait for the job to end for good (not requeued); its fields. ``requeues``: each time it
        is requeued, let the next attempt start once the last one left the nodes (SLURM holds a
        requeued job two minutes, its ``BeginTime``; a job started while its last attempt was
        still being killed failed at once)."""
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        released = [0]

        def done(fields: dict) -> bool:
            if fields.get("JobState") in final:
                return True
            restarts = int(fields.get("Restarts", 0))
            if requeues and restarts > released[0] and fields["JobState"] == "PENDING" and self.idle():
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                released[0] = restarts
            return False

        return self.wait(job_id, done, timeout)

    def job_env(self, hook: Path | None = None) -> dict:
        """What a job is submitted with, as from a shell where the project is installed: the
        cluster's environment with this Python's ``bin`` first on ``PATH``, without this process's
        rendezvous or job variables, and ``hook`` (a folder with a ``sitecustomize.py``) on
        ``PYTHONPATH``."""
        from yamlformer.recipes.parallel.rendezvous import RENDEZVOUS_ENV

        env = {k: v for k, v in self.env.items() if k not in RENDEZVOUS_ENV and not k.startswith("SLURM_JOB")}
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        if hook is not None:
            env["PYTHONPATH"] = str(hook)
        return env

    def submit(self, script: Path, *flags: str, env: dict | None = None) -> int:
        """``sbatch FLAGS SCRIPT`` from the script's folder, in ``env`` (default :meth:`job_env`); the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *flags, str(script)],
            env=env or self.job_env(),
            cwd=script.parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return int(done.stdout.strip().split(";")[0])

    def tasks(self, job_id: int, command: str = "yamlformer.builder.cli") -> dict[int, int]:
        """The job's tasks that run ``command`` (in their command line): pid by task rank
        (``SLURM_PROCID``). A task is a process ``slurmstepd`` started (not ``srun``, whose command
        line names the same command, nor a process a task started)."""
        job, rank = f"SLURM_JOB_ID={job_id}".encode(), b"SLURM_PROCID="
        ranks = {}
        for pid, environ, argv in _processes(self.conf):
            if job in environ and command in argv and b"slurmstepd" in _command(_parent(pid)):
                ranks[int(next(v for v in environ if v.startswith(rank))[len(rank) :])] = pid
        return ranks

    def idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(node) == "idle" for node in NODES)


def _config(root: Path, host: str, ctld_port: int, node_ports: list[int], munge_socket: Path) -> str:
    # job ids (and so the ports their tasks meet at, yamlformer.recipes.parallel.rendezvous.slurm_port)
    # of their own: two clusters on one host (two test sessions) would both number their jobs from 1
    first_job = random.SystemRandom().randrange(1, 1_000_000)
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS} RealMemory=4000 State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    )
    return f"""\
ClusterName=yamlformer
FirstJobId={first_job}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


HOSTS = Path("/etc/hosts")


@contextlib.contextmanager
def _resolvable_nodes(root: Path):
    """The nodes' names resolve while the cluster runs: where they do not, ``/etc/hosts`` gets a
    line naming them at 127.0.0.1, this cluster's own (it names ``root``), removed when it stops;
    another cluster's line (another test session's) is never taken away with it."""
    mark = "# yamlformer's test SLURM"
    try:
        for node in NODES:
            socket.gethostbyname(node)
        named = mark in HOSTS.read_text()  # resolved by another cluster's line, gone when it stops
    except OSError:
        named = True
    line = f"127.0.0.1 {' '.join(NODES)}  {mark} in {root}\n"
    if named:
        text = HOSTS.read_text()
        HOSTS.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)
    try:
        yield
    finally:
        if named:
            HOSTS.write_text(HOSTS.read_text().replace(line, ""))


def _wait_for(ready, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {log}:\n{log.read_text()[-2000:]}" for log in logs if log.exists())
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s\n{tails}")


@contextlib.contextmanager
def cluster(root: Path):
    """A SLURM of two nodes on this host, from ``root`` (configuration, state, logs): yields its
    :class:`Cluster` once ``sinfo`` shows both nodes idle, and stops every daemon afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    munge_socket = root / "munge" / "munge.socket"
    munge_socket.parent.mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ports = [_free_port() for _ in range(1 + len(NODES))]
    host = socket.gethostname().split(".")[0]
    (root / "state").mkdir()
    (root / "slurm.conf").write_text(_config(root, host, ports[0], ports[1:], munge_socket))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"
    found = Cluster(root, env)

    def start(*argv: str) -> None:
        found.processes.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        )

    with _resolvable_nodes(root):
        try:
            start(
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--log-file={root / 'munge' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            )
            _wait_for(munge_socket.exists, 20, "munged", [root / "munge" / "munged.log"])
            start(_which("slurmctld"), "-D", "-i", "-f", str(found.conf))
            for node in NODES:
                start(_which("slurmd"), "-D", "-N", node, "-f", str(found.conf))
            logs = [root / "slurmctld.log", *(root / f"slurmd-{node}.log" for node in NODES)]
            _wait_for(found.idle, START_TIMEOUT, "SLURM's nodes", logs)
            yield found
        finally:
            _stop(found)


def _stop(found: Cluster) -> None:
    """Cancel the cluster's jobs, let them end, then stop its daemons (the last started first)."""
    with contextlib.suppress(Exception):
        found.run("scancel", "--full", "--user=root", check=False, timeout=10)
        deadline = time.monotonic() + 30
        while found.run("squeue", "-h", check=False, timeout=10).stdout.strip() and time.monotonic() < deadline:
            time.sleep(1)
    for pid in _jobs_processes(found.conf):  # what a job left behind when its steps would not end
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for process in reversed(found.processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in reversed(found.processes):
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _processes(conf: Path):
    """``(pid, environment, command line)`` of every process of this cluster's jobs (their
    environment names its ``SLURM_CONF``), not of its daemons; environment a list of ``NAME=value``
    bytes, command line a string."""
    ours = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        name = Path(command.split(b"\0")[0].decode(errors="replace")).name.split(":")[0]
        daemon = name in ("munged", "slurmctld", "slurmd")
        if ours in environ and not daemon and b"slurmstepd" not in command:
            yield int(entry.name), environ, command.replace(b"\0", b" ").decode(errors="replace")


def _jobs_processes(conf: Path) -> list[int]:
    """The processes of this cluster's jobs, not its daemons."""
    return [pid for pid, _, _ in _processes(conf)]


def _parent(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _command(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of ``signum`` (``SigCgt`` in ``/proc/PID/status``)."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def loaded(pid: int, library: str) -> bool:
    """Whether process ``pid`` has mapped a shared library whose file name starts with ``library``."""
    try:
        maps = (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False
    return any(Path(line.split()[-1]).name.startswith(library) for line in maps.splitlines() if "/" in line)
