"""``torchrun`` across two nodes, here two agents on this one machine (c10d rendezvous on loopback,
gloo, CPU ranks), each started with the line ``builder plan`` prints, ``$NODE_RANK`` and
``$MASTER_ADDR`` filled in: DDP, FSDP and HSDP (``data_parallel: hybrid``) train as one process at
the same global batch, write one checkpoint set, and come back from a rank killed with SIGKILL:
the same command launched again resumes from the last checkpoint, and under ``--max-restarts 1``
the agents restart the ranks, which resume by themselves. ``python -m pytest -m launch
tests/test_torchrun_launch.py`` (about a minute and a half on 2 cores)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sharded_helpers import assert_same_losses, losses
from torchrun_helpers import CPU, Agents, agent_flags, holding_env, launch, planned, wait_for_file, with_sets

pytestmark = pytest.mark.launch

STEPS = 8
#: the step whose checkpoint the killed rank saved before it died (checkpoints every 2 steps,
#: validation every 4: the resumed run validates at 8 as the unbroken one does)
KILLED_AT = 6

#: strategy -> (devices per node, the plan's data-parallel mode, sets over the plan's line)
LAYOUTS = {
    "ddp": (1, "replicate", ("trainer.strategy=ddp", "trainer.data_parallel=shard")),
    "fsdp": (1, "shard", ()),
    "hybrid": (2, "hybrid", ()),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The losses of one process at the launches' global batch (4), to the launches' last step."""
    from yamlformer.recipes.training.run import run

    folder = tmp_path_factory.mktemp("one")
    recipe, _ = planned(folder, nodes=2, per_node=1, data_parallel="shard")
    run(recipe, {"trainer.max_steps": STEPS, "trainer.output_dir": str(folder / "run")}, samples=False)
    return losses(folder / "run")


def _line(folder: Path, strategy: str) -> str:
    """The plan's ``torchrun`` line for ``strategy`` on 2 nodes, with the CPU flags and the steps."""
    per_node, mode, sets = LAYOUTS[strategy]
    _, line = planned(folder, nodes=2, per_node=per_node, data_parallel=mode)
    assert "--node-rank=$NODE_RANK" in line and "--rdzv-endpoint=$MASTER_ADDR:" in line, line
    return with_sets(line, *CPU, *sets, f"trainer.max_steps={STEPS}", flags=("--no-samples",))


def _run_folder(folder: Path) -> Path:
    """The one run folder the launch wrote (the plan's relative ``trainer.output_dir``)."""
    found = [p.parent for p in folder.rglob("checkpoints") if p.is_dir()]
    assert len(found) == 1, found  # one checkpoint set, however many ranks
    return found[0]


def _killed_launch(folder: Path, line: str, ranks: int) -> tuple[list[int], list[str], float]:
    """``line`` launched with the last rank held after step :data:`KILLED_AT`'s checkpoint, then
    killed with SIGKILL: the agents' exit statuses, outputs and the wall time."""
    env, pid_file = holding_env(folder, KILLED_AT, ranks - 1)
    start = time.monotonic()
    with Agents(line, [folder, folder], folder / "logs", env=env) as agents:
        os.kill(int(wait_for_file(pid_file, agents)), signal.SIGKILL)  # a real rank, as the OOM killer kills
        codes = agents.wait()
        return codes, [agents.output(n) for n in range(2)], time.monotonic() - start


def _same_as_one(folder: Path, one: dict, ranks: int, strategy: str) -> None:
    """One checkpoint set, at the last step, whose losses equal one process's to 4 digits."""
    run = _run_folder(folder)
    last = run / "checkpoints" / "last.ckpt"
    if strategy != "ddp":
        assert last.is_dir() and len(list(last.glob("*.distcp"))) == ranks  # each rank its own shards, once
    ours = losses(run)
    assert [s for s, _ in ours["val"]] == [4, 8] and ours["train"][-1][0] == STEPS
    assert_same_losses(ours, one, atol=1e-4)
    print(
        f"{strategy}: "
        + ", ".join(f"step {s} {a:.4f} / {b:.4f}" for (s, a), (_, b) in zip(ours["train"], one["train"]))
    )


def test_ddp_killed_then_the_same_launch_again_resumes_and_trains_as_one_process(tmp_path, one_process):
    line = _line(tmp_path, "ddp")
    codes, outs, first = _killed_launch(tmp_path, line, 2)
    assert all(code != 0 for code in codes), outs  # no restarts asked: the launch fails
    start = time.monotonic()
    codes, outs = launch(line, [tmp_path, tmp_path], tmp_path / "logs-again")
    again = time.monotonic() - start
    assert codes == [0, 0], outs
    said = "\n".join(outs)
    assert "resuming from runs/" in said and f"step {STEPS}: val loss" in said, said[-3000:]
    _same_as_one(tmp_path, one_process, 2, "ddp")
    print(f"ddp: the killed launch {first:.1f} s, the same launch again {again:.1f} s")


@pytest.mark.parametrize("strategy", ["fsdp", "hybrid"])
def test_max_restarts_restarts_a_killed_rank_and_it_resumes_as_one_process(strategy, tmp_path, one_process):
    ranks = 2 * LAYOUTS[strategy][0]
    line = agent_flags(_line(tmp_path, strategy), "--max-restarts=1")
    codes, outs, wall = _killed_launch(tmp_path, line, ranks)
    assert codes == [0, 0], outs
    said = "\n".join(outs)
    assert said.count("resuming from runs/") == 1, said[-3000:]  # the restarted rank 0 says it, once
    _same_as_one(tmp_path, one_process, ranks, strategy)
    print(f"{strategy}: killed at step {KILLED_AT} and restarted, {wall:.1f} s")


# -- what a user meets: one line each, no hang ------------------------------------------------------


def _every_rank_refused(line: str, cwds: list[Path], logs: Path, *needles: str) -> float:
    """Launch ``line`` and assert each node's ranks stopped with exit status 1 in lines holding
    ``needles``, no traceback and no internal error of theirs (torchrun's own ChildFailedError
    report follows what the ranks printed: the launcher's, not the run's); the wall time."""
    start = time.monotonic()
    codes, outs = launch(line, cwds, logs, timeout=180)
    wall = time.monotonic() - start
    assert all(code != 0 for code in codes), outs
    for out in outs:
        said = out.split("torch/distributed/elastic/multiprocessing/api.py", 1)[0]
        assert "Traceback" not in said and "internal error" not in said, said[-3000:]
        assert all(needle in said for needle in needles), said[-3000:]
        assert "(exitcode: 70)" not in out  # the one-line error, not an internal one
    # the agent that did not host the store may lose it before it reports its rank's status
    # (torchrun's RendezvousConnectionError): the other reports it
    assert any("failed (exitcode: 1)" in out for out in outs), outs
    return wall


def test_num_nodes_the_recipe_disagrees_with_is_one_line_at_its_field(tmp_path):
    """A recipe written for one node (``trainer.num_nodes: 1`` at its line) launched on two: each
    rank stops before any work, naming the field and what torchrun started (each node trained
    alone as one device, both into one run folder)."""
    recipe, _ = planned(tmp_path, nodes=2, per_node=1, data_parallel="shard")
    text = recipe.read_text().replace("trainer:\n", "trainer:\n  num_nodes: 1\n", 1)
    recipe.write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.strip() == "num_nodes: 1")
    command = (
        "torchrun --nnodes=2 --nproc-per-node=1 --node-rank=$NODE_RANK --rdzv-backend=c10d "
        f"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT -m yamlformer.builder.cli train {recipe} --no-samples"
    )
    needles = (f"recipe.yaml:{line}:14: trainer.num_nodes: 1, but torchrun started 2 nodes",)
    wall = _every_rank_refused(command, [tmp_path, tmp_path], tmp_path / "logs", *needles)
    print(f"num_nodes refused on both nodes in {wall:.1f} s")


def test_a_run_folder_only_one_node_sees_is_named(tmp_path):
    """The plan's line from two folders (the nodes' own disks): its relative ``trainer.output_dir``
    is a different folder on each node. Every rank stops as they meet, naming the folder, before a
    sharded checkpoint is split between the two disks."""
    elsewhere = tmp_path / "node-1"
    elsewhere.mkdir()
    needles = ("builder train: trainer.output_dir runs/", "does not see the files rank 0")
    wall = _every_rank_refused(_line(tmp_path, "fsdp"), [tmp_path, elsewhere], tmp_path / "logs", *needles)
    assert not list(tmp_path.rglob("*.distcp"))  # no checkpoint split between them
    print(f"an unshared run folder refused in {wall:.1f} s")
