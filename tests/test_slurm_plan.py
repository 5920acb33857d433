"""``builder plan --sbatch FILE``'s batch file, submitted unchanged to a real SLURM (the ``slurm``
fixture, tests/slurm_helpers.py): two nodes x one task, FSDP with ``data_parallel: hybrid`` on CPU
ranks (gloo, ``--no-gres``); Lightning detects SLURM, the ranks meet as one group across the two
nodes and the run's one checkpoint is written. ``python -m pytest -m launch``."""

from __future__ import annotations

import time

import pytest
import yaml
from recipe_helpers import TINY_SPEC, history, tiny_recipe

from yamlformer.builder.cli import main

pytestmark = pytest.mark.launch

STEPS = 12


def test_the_plans_batch_file_runs_unchanged_on_two_nodes(slurm, tmp_path, tmp_path_factory, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({**TINY_SPEC, "vocab_size": 95}, sort_keys=False))  # the tokenizer sets it
    cache = tmp_path_factory.getbasetemp() / "slurm-cache"
    recipe = tiny_recipe(tmp_path, data={"cache_dir": str(cache)}, trainer={"log_every_n_steps": 1})
    script = tmp_path / "train.sbatch"
    argv = ["plan", str(spec), "--gpus", "2", "--nodes", "2", "--global-batch", "8", "--seq-len", "32"]
    argv += ["--dtype", "fp32", "--data-parallel", "hybrid", "--tensor-parallel", "1", "--pipeline-parallel", "1"]
    argv += ["--recipe", str(recipe), "--tokens", str(STEPS * 8 * 32), "--sbatch", str(script), "--no-gres"]
    assert main(argv) == 0, capsys.readouterr()
    assert f"SLURM batch file written: sbatch {script}" in capsys.readouterr().out
    text = script.read_text()
    for line in ("--signal=USR1@", "--requeue", "--open-mode=append", "srun --kill-on-bad-exit=1 builder train"):
        assert line in text
    assert "--gres" not in text and "$?" not in text

    started = time.monotonic()
    job = slurm.submit(script)  # as printed: `sbatch train.sbatch` from its folder
    fields = slurm.finished(job, 300)
    seconds = time.monotonic() - started
    log_file = tmp_path / f"yamlformer-{job}.out"
    log = log_file.read_text(errors="replace")
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert fields["NodeList"] == "n[1-2]" and fields["NumNodes"] == "2", fields
    assert "SLURM auto-requeueing enabled" in log, log[-3000:]  # Lightning's SLURM environment
    assert "All distributed processes registered. Starting with 2 processes" in log, log[-3000:]
    assert log.count("devices: cpu x 1 on each of 2 nodes, strategy fsdp") == 1, log[-3000:]  # said by rank 0
    checkpoints = tmp_path / "runs" / "tiny-decoder-2gpus" / "checkpoints"
    last = checkpoints / "last.ckpt"  # one sharded set: each rank's shard, rank 0's meta.pt
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.ckpt", "last-1.ckpt", "last.ckpt"]
    steps = [s for s, _ in history(last / "meta.pt")["train"]]
    assert steps[-1] == STEPS, steps
    print(f"\nbuilder plan --sbatch, 2 nodes x 1 task, fsdp hybrid: {seconds:.1f} s from submission")
