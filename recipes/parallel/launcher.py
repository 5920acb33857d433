"""What a launcher started, checked against the recipe before and as the ranks meet, each problem
one line instead of Lightning's traceback or a wait of half an hour.

* :func:`check_launcher`: the nodes and processes per node ``torchrun`` (``GROUP_WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``) or SLURM (``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``) started must be the
  recipe's ``trainer.num_nodes`` and ``trainer.devices``, named at the recipe's line.
* :func:`wait_for_rank_zero`: a rank other than 0 that meets the others at an address it connects
  to (Lightning's own environment, SLURM) waits for something to listen there at most
  ``BUILDER_RENDEZVOUS_TIMEOUT`` seconds, then names the address and where it came from (torch's
  store would retry for 30 minutes). Under torchrun the agent's store is there already.
* :class:`SharedRunFolder`: once the process group exists, rank 0 writes a marker into the run
  folder and every rank must see it; a folder only one node sees (a relative or node-local
  ``trainer.output_dir``) is named, before a checkpoint is split between the nodes' disks.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import lightning as L
import torch.distributed as dist

from yamlformer.builder.spec.loader import SpecError
from yamlformer.builder.spec.source import Mark, Problem
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.parallel.mesh import device_count
from yamlformer.recipes.parallel.rendezvous import under_slurm
from yamlformer.recipes.recipe.located import LocatedRecipe
from yamlformer.recipes.say import say

#: seconds a rank waits for rank 0 to listen at the rendezvous address (torchrun's join timeout)
RENDEZVOUS_TIMEOUT = 600.0


def launched(environ: Mapping[str, str] | None = None) -> tuple[str, dict, dict] | None:
    """``(launcher, {"nodes": n, "per_node": p}, the variables each came from)`` for a process a
    launcher started with a known layout, else None (Lightning starts the processes itself)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID") and env.get("GROUP_WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
        names = {"nodes": "--nnodes, GROUP_WORLD_SIZE", "per_node": "--nproc-per-node, LOCAL_WORLD_SIZE"}
        return "torchrun", {"nodes": env["GROUP_WORLD_SIZE"], "per_node": env["LOCAL_WORLD_SIZE"]}, names
    if under_slurm(env):
        names = {"nodes": "--nodes, SLURM_NNODES", "per_node": "--ntasks-per-node, SLURM_NTASKS_PER_NODE"}
        values = {"nodes": env.get("SLURM_NNODES", ""), "per_node": env.get("SLURM_NTASKS_PER_NODE", "")}
        return "SLURM", values, names
    return None


def check_launcher(located: LocatedRecipe, environ: Mapping[str, str] | None = None) -> None:
    """The launcher's nodes and processes per node are the ``trainer.num_nodes`` and
    ``trainer.devices`` of ``located`` (the recipe as loaded); else a :class:`SpecError`, one line
    per field at the recipe's line. Restarts
    that would fail (:func:`kept_store`) are a warning."""
    store = kept_store(os.environ if environ is None else environ)
    if store:
        say(f"warning: {store}")
    found = launched(environ)
    if found is None:
        return
    launcher, values, names = found
    started = {k: int(v) for k, v in values.items() if v.isdigit()}  # SLURM's "2(x3)": uneven nodes, unchecked
    if len(started) < 2:
        return
    trainer = located.recipe.trainer
    ours = {"nodes": trainer.num_nodes, "per_node": device_count(trainer, check=False)}
    shown = f"{started['nodes']} node{'s' * (started['nodes'] != 1)} ({names['nodes']}) of {started['per_node']}"
    shown += f" process{'es' * (started['per_node'] != 1)} each ({names['per_node']})"
    problems = []
    for key, name in (("nodes", "num_nodes"), ("per_node", "devices")):
        if ours[key] != started[key]:
            value = getattr(trainer, name)
            where, note = _written_at(located, name, value, type(trainer).model_fields[name].default)
            if value != ours[key]:
                note += f" ({ours[key]} process{'es' * (ours[key] != 1)} here)"
            problems.append(
                Problem.at(
                    where,
                    f"trainer.{name}",
                    f"{value}{note}, but {launcher} started {shown}; set trainer.{name}: {started[key]}",
                )
            )
    if problems:
        raise SpecError(problems)


def kept_store(environ: Mapping[str, str]) -> str | None:
    """Why restarts under this torchrun would fail, or None: its agents keep one store across
    attempts (their default), and the ranks of a restart read the addresses the dead ranks
    published there and fail to connect (pytorch#135712); ``builder plan``'s line turns it off."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if restarts < 1 or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"torchrun --max-restarts {restarts} keeps its agents' store across restarts, where restarted ranks "
        "read the dead ranks' addresses and fail to connect (pytorch#135712): start the agents with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as builder plan's line does"
    )


def _written_at(located: LocatedRecipe, name: str, value, default) -> tuple[Mark, str]:
    """Where the recipe's ``trainer.NAME`` was set to ``value``: its line, a ``--set`` of the
    command line, or the recipe file itself when it took the default (then the message says so)."""
    doc, recipe_file = located.written, located.file
    section = doc.data.get("trainer") if isinstance(doc.data, dict) else None
    written = isinstance(section, dict) and name in section
    if written and section[name] == value:
        return doc.value_mark(("trainer", name)) or Mark(str(recipe_file)), ""
    if written or value != default:
        return Mark(f"<--set trainer.{name}={value}>"), ""
    return Mark(str(recipe_file)), " (the default)"


# -- meeting rank 0 ---------------------------------------------------------------------------


def rendezvous_timeout() -> float:
    """``BUILDER_RENDEZVOUS_TIMEOUT`` seconds (default :data:`RENDEZVOUS_TIMEOUT`)."""
    raw = os.environ.get("BUILDER_RENDEZVOUS_TIMEOUT", "").strip()
    try:
        value = float(raw) if raw else RENDEZVOUS_TIMEOUT
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RecipeError(f"BUILDER_RENDEZVOUS_TIMEOUT {raw!r}: give the seconds to wait for rank 0, more than 0")
    return value


def wait_for_rank_zero(trainer: L.Trainer) -> None:
    """A rank other than 0, about to meet the others at its cluster environment's address, waits
    until something listens there, at most :func:`rendezvous_timeout` seconds; then one line naming
    the address and the variables it came from. Rank 0 listens there itself; under torchrun the
    agent's store already does."""
    strategy = trainer.strategy
    env = getattr(strategy, "cluster_environment", None)  # a parallel strategy's (one device has none)
    if env is None or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    strategy.set_world_ranks()  # as its setup does next, from the environment (NODE_RANK, SLURM_PROCID...)
    if strategy.world_size < 2 or strategy.global_rank == 0:
        return
    addr, port = env.main_address, env.main_port
    limit = rendezvous_timeout()
    deadline = time.monotonic() + limit
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, limit)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RecipeError(_nobody_listens(strategy.global_rank, addr, port, limit, exc)) from None
        time.sleep(min(1.0, limit / 10))


def _nobody_listens(rank: int, addr: str, port: int, waited: float, exc: OSError) -> str:
    where = (
        "the first node of SLURM_JOB_NODELIST, MASTER_PORT from the job id"
        if under_slurm()
        else "MASTER_ADDR, MASTER_PORT"
    )
    reason = exc.strerror or type(exc).__name__
    return (
        f"rank {rank}: nothing listens at {addr}:{port} ({where}) after {waited:g} s ({reason}; "
        "BUILDER_RENDEZVOUS_TIMEOUT sets the wait): start rank 0 (NODE_RANK 0) too, with the same "
        "MASTER_ADDR and MASTER_PORT, the address of its node"
    )


# -- a run folder every node sees --------------------------------------------------------------


class SharedRunFolder(L.Callback):
    """At setup, once the ranks have met: rank 0 writes a marker with a fresh token into the run
    folder and every rank reads it back; a rank that does not see it stops the run (every rank,
    in one line naming the folder) before a checkpoint is written or read."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2 or not dist.is_available() or not dist.is_initialized():
            return
        token = [secrets.token_hex(8) if trainer.global_rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        marker = self.out / f".ranks-see-{token[0]}"
        if trainer.global_rank == 0:
            marker.write_text(socket.gethostname())
        dist.barrier()
        seen = [None] * trainer.world_size
        dist.all_gather_object(seen, (marker.is_file(), socket.gethostname()))
        dist.barrier()
        if trainer.global_rank == 0:
            marker.unlink(missing_ok=True)
        blind = [(rank, host) for rank, (ok, host) in enumerate(seen) if not ok]
        if blind:
            rank, host = blind[0]
            others = f" and {len(blind) - 1} more" if len(blind) > 1 else ""
            raise RecipeError(
                f"trainer.output_dir {self.out}: rank {rank} (on {host}){others} does not see the files rank 0 "
                f"(on {seen[0][1]}) writes there; every node must see one run folder: give a path on a "
                "filesystem all nodes share (an absolute one, if the nodes start in different folders)"
            )
