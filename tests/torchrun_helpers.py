"""Two ``torchrun`` agents on this one machine, as two nodes: each started with the line ``builder
plan`` prints (``$NODE_RANK`` and ``$MASTER_ADDR`` filled in by the shell, as on a cluster), on a
free loopback port, every wait bounded and every process group killed when a test ends."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from recipe_helpers import TINY_SPEC, tiny_recipe

#: the CPU flags every line here adds to the plan's (the README's "on GPUs drop trainer.accelerator=cpu"):
#: fp32, so the ranks' losses equal one process's; the tests' own step count
CPU = ("trainer.accelerator=cpu", "trainer.precision=32")
#: seconds one launch may take before its agents are killed and the test fails
LAUNCH_TIMEOUT = 240


def free_port() -> int:
    """A port nothing listens on (the kernel's pick, closed again: the agent binds it at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planned(folder: Path, *, nodes: int, per_node: int, data_parallel: str, batch: int = 4) -> tuple[Path, str]:
    """A tiny recipe and spec in ``folder`` and the ``torchrun`` line ``builder plan`` prints for
    ``nodes`` x ``per_node`` devices in that data-parallel mode, at a global batch of ``batch``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.yaml").write_text(yaml.safe_dump({**TINY_SPEC, "vocab_size": 95}, sort_keys=False))
    trainer = {"val_check_interval": 4, "limit_val_batches": 1, "checkpoint_every_n_steps": 2, "output_dir": None}
    recipe = tiny_recipe(folder, model={"spec": "tiny.yaml"}, schedule={"type": "constant", "warmup_steps": 2})
    doc = yaml.safe_load(recipe.read_text())
    doc["trainer"] = {k: v for k, v in {**doc["trainer"], **trainer}.items() if v is not None}
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    devices = nodes * per_node
    argv = ["plan", "tiny.yaml", "--gpus", str(devices), "--gpus-per-node", str(per_node)]
    argv += ["--global-batch", str(batch), "--seq-len", "32", "--micro-batch", str(batch // devices)]
    argv += ["--data-parallel", data_parallel, "--tensor-parallel", "1", "--pipeline-parallel", "1"]
    argv += ["--context-parallel", "1", "--checkpointing", "none", "--recipe", "recipe.yaml", "--launchable"]
    done = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", *argv, "--json"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return recipe, json.loads(done.stdout)["launch"]["torchrun"]


def with_sets(line: str, *sets: str, flags: tuple[str, ...] = ()) -> str:
    """``line`` with ``--set`` flags (and plain ``flags``) added after the plan's, which they override."""
    return " ".join([line, *(f"--set {shlex.quote(s)}" for s in sets), *flags])


def agent_flags(line: str, *flags: str) -> str:
    """``line`` with torchrun flags of its own (``--max-restarts 1``) before its module."""
    head, module, rest = line.partition(" -m ")
    return f"{head} {' '.join(flags)}{module}{rest}"


def _torchrun_here(folder: Path) -> Path:
    """A folder whose ``torchrun`` is this interpreter's (``python -m torch.distributed.run``), so the
    printed line runs this checkout under any environment's ``PATH``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "torchrun"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    shim.chmod(0o755)
    return bin_dir


class Agents:
    """The agents of one launch: node ``n`` runs ``line`` in ``cwds[n]`` through ``bash -c`` with
    ``NODE_RANK=n`` and ``MASTER_ADDR``/``MASTER_PORT`` (the endpoint) set, each in its own
    process group, its output in ``logs/node-N.log``."""

    def __init__(self, line: str, cwds: list[Path], logs: Path, addr: str = "127.0.0.1", env: dict | None = None):
        self.port = free_port()
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"node-{n}.log" for n in range(len(cwds))]
        path = os.pathsep.join([str(_torchrun_here(logs.parent)), os.environ.get("PATH", "")])
        self.procs = []
        for node, cwd in enumerate(cwds):
            extra = {"NODE_RANK": str(node), "MASTER_ADDR": addr, "MASTER_PORT": str(self.port), "PATH": path}
            child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC"))}
            child_env.update(extra, **(env or {}))
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                child_env.pop(name, None)
            with self.logs[node].open("ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        ["bash", "-c", line],
                        cwd=cwd,
                        env=child_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> list[int]:
        """Every agent's exit status; after ``timeout`` seconds the agents are killed and the test fails."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                tails = "\n".join(f"node {n}: {self.output(n)[-3000:]}" for n in range(len(self.procs)))
                raise AssertionError(f"the launch did not end in {timeout} s:\n{tails}") from None
        return [proc.returncode for proc in self.procs]

    def kill(self) -> None:
        """SIGKILL to every agent's process group (its workers are in it)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def launch(line: str, cwds: list[Path], logs: Path, timeout: float = LAUNCH_TIMEOUT, **kwargs) -> tuple[list, list]:
    """One launch to its end: the agents' exit statuses and outputs."""
    with Agents(line, cwds, logs, **kwargs) as agents:
        codes = agents.wait(timeout)
        return codes, [agents.output(n) for n in range(len(cwds))]


#: the ``sitecustomize`` of a killed launch: in its first attempt (``TORCHELASTIC_RESTART_COUNT``
#: 0) the rank ``RANK`` writes its process id to ``SIGNALS/pid`` once step ``AT``'s checkpoint is
#: saved and waits there, so the test kills it at a known step however loaded the machine is
_HOLD = """
import os
import time
from pathlib import Path

if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a worker, not the agent
    from yamlformer.recipes.training import checkpointing as _checkpointing

SIGNALS, AT, RANK = Path({signals!r}), {at}, {rank}


def _holding(self, trainer, *args, **kwargs):
    _real(self, trainer, *args, **kwargs)
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first and trainer.global_rank == RANK and trainer.global_step == AT:
        (SIGNALS / ".pid").write_text(str(os.getpid()))
        os.replace(SIGNALS / ".pid", SIGNALS / "pid")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)


if "TORCHELASTIC_RESTART_COUNT" in os.environ:
    _real = _checkpointing.RecipeCheckpoint.on_train_batch_end
    _checkpointing.RecipeCheckpoint.on_train_batch_end = _holding
"""


def holding_env(folder: Path, at: int, rank: int) -> tuple[dict, Path]:
    """The environment that makes ``rank`` wait after step ``at``'s checkpoint (:data:`_HOLD`), and
    the file its process id appears in."""
    signals = folder / "hold"
    (signals / "hook").mkdir(parents=True, exist_ok=True)
    (signals / "hook" / "sitecustomize.py").write_text(_HOLD.format(signals=str(signals), at=at, rank=rank))
    paths = [str(signals / "hook"), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}, signals / "pid"


def wait_for_file(path: Path, agents: Agents, timeout: float = LAUNCH_TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents.procs):
            agents.kill()
            tails = "\n".join(f"node {n}: {agents.output(n)[-3000:]}" for n in range(len(agents.procs)))
            raise AssertionError(f"{path.name} never appeared:\n{tails}")
        time.sleep(0.05)
    return path.read_text()
