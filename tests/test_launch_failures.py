"""What a user meets launching across nodes, each in one line and fast (the launches themselves:
tests/test_torchrun_launch.py, ``pytest -m launch``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from recipe_helpers import tiny_recipe

from yamlformer.builder.spec.loader import SpecError
from yamlformer.recipes.data.dataset_folder import check_output
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.parallel.launcher import check_launcher, kept_store
from yamlformer.recipes.parallel.rendezvous import RENDEZVOUS_ENV


def test_a_cache_another_node_has_just_started_to_fill_is_not_a_foreign_folder(tmp_path):
    """Two nodes sharing ``data.cache_dir`` start at once: the second sees the first's lock and the
    temp file its settings are written through, and waits for it (it refused the folder)."""
    out = tmp_path / "tokenized" / "abc"
    out.mkdir(parents=True)
    (out / ".lock").write_text("pid 1 on node-0\n")
    (out / ".started.json.tmp-4242").write_bytes(b"{")
    check_output(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="a folder with other files in it"):
        check_output(out)


# -- the launcher's layout against the recipe's ---------------------------------------------------

#: what torchrun sets in each rank of ``torchrun --nnodes=2 --nproc-per-node=1``
TORCHRUN_2X1 = {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}


def _recipe(tmp_path, **trainer):
    from yamlformer.recipes.tasks import load_recipe

    path = tiny_recipe(tmp_path, trainer={**trainer, "output_dir": str(tmp_path / "run")})
    return path, load_recipe(path)


def test_num_nodes_that_disagrees_with_torchrun_is_named_at_its_line(tmp_path):
    path, recipe = _recipe(tmp_path, num_nodes=1, devices=1)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("num_nodes:"))
    with pytest.raises(SpecError) as caught:
        check_launcher(recipe, TORCHRUN_2X1)
    (problem,) = caught.value.problems
    assert str(problem).startswith(f"{path}:{line}:") and problem.path == "trainer.num_nodes", str(problem)
    assert "1, but torchrun started 2 nodes (--nnodes, GROUP_WORLD_SIZE) of 1 process each" in str(problem)
    assert str(problem).endswith("set trainer.num_nodes: 2")
    check_launcher(recipe, {**TORCHRUN_2X1, "GROUP_WORLD_SIZE": "1"})  # agreeing: nothing to say
    check_launcher(recipe, {})  # Lightning starts the processes itself: nothing to compare


def test_devices_under_slurm_and_a_default_are_named_so(tmp_path):
    path, recipe = _recipe(tmp_path, devices=1)
    slurm = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train"}
    with pytest.raises(SpecError) as caught:
        check_launcher(recipe, slurm)
    lines = [str(p) for p in caught.value.problems]
    assert len(lines) == 2, lines
    assert lines[1].startswith(f"{path}:") and "trainer.devices: 1, but SLURM started 2 nodes (--nodes" in lines[1]
    assert lines[0] == (
        f"{path}: trainer.num_nodes: 1 (the default), but SLURM started 2 nodes (--nodes, SLURM_NNODES) of 2 "
        "processes each (--ntasks-per-node, SLURM_NTASKS_PER_NODE); set trainer.num_nodes: 2"
    )
    check_launcher(recipe, {**slurm, "SLURM_NTASKS_PER_NODE": "2(x2)"})  # uneven nodes: left to SLURM


# -- rank 0 nobody started --------------------------------------------------------------------------


def test_a_rank_whose_rank_zero_never_listens_stops_in_one_line(tmp_path):
    """``builder train`` on node 1 with MASTER_ADDR and MASTER_PORT set, as Lightning launches a
    node by hand, and no node 0: a bounded wait and one line naming the address and its
    variables, not torch's store retrying for 30 minutes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    path = tiny_recipe(tmp_path, trainer={"num_nodes": 2, "devices": 1, "strategy": "ddp", "max_steps": 2})
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1", "BUILDER_RENDEZVOUS_TIMEOUT": "2"}
    env = {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}, **env}
    command = [sys.executable, "-m", "yamlformer.builder.cli", "train", str(path), "--no-samples"]
    child = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    err = err.decode(errors="replace")
    assert child.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert f"builder train: rank 1: nothing listens at 127.0.0.1:{port} (MASTER_ADDR, MASTER_PORT) after 2 s" in err


def test_restarts_on_torchruns_kept_store_are_warned_of():
    """torchrun's agents keep one store across restarts unless told not to; a restart then fails
    to connect (tests/test_torchrun_launch.py restarts with it off, as builder plan's line runs)."""
    kept = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "start the agents with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in kept_store(kept)
    assert kept_store({**kept, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # rank 0 starts a fresh one
    assert kept_store({**kept, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restarts asked
    assert kept_store({}) is None
