"""The run folder: one run at a time, checked writable before any work, resumed only by the
recipe that made it (every differing field named, one line each)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
from recipe_helpers import REPO, one_error_line, tiny_recipe

HOLD = """
import sys
from yamlformer.recipes.training.run_folder import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def _holder(folder):
    env = dict(os.environ)
    folder.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_second_run_stops_at_once_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    from yamlformer.builder.cli import main

    recipe = tiny_recipe(tmp_path, trainer={"max_steps": 2, "output_dir": str(tmp_path / "run")})
    holder = _holder(tmp_path / "run")
    try:
        assert main(["train", str(recipe), "--no-samples"]) == 1
        line = one_error_line(capsys.readouterr().err, "builder train:")
        assert f"trainer.output_dir {tmp_path / 'run'} is in use" in line and f"pid {holder.pid} on host " in line
        assert not (tmp_path / "cache" / "tokens").exists()  # stopped before the corpus and the tokenizer
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", str(recipe), "--no-samples"]) == 0  # the holder was killed: its lock is stale
    out = capsys.readouterr().out
    assert f"taking over {tmp_path / 'run' / 'run.lock'}" in out and f"pid {holder.pid}" in out
    assert (tmp_path / "run" / "run.lock").read_text() == ""  # a clean end leaves no holder


def test_a_record_from_another_host_is_trusted_while_it_is_fresh(tmp_path):
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.run_folder import STALE_S, RunLock

    lock_file = tmp_path / "run.lock"
    lock_file.write_text(json.dumps({"pid": 4242, "host": "node-17", "started": "2026-01-01T00:00:00"}))
    with pytest.raises(RecipeError, match="in use by another `builder train` \\(pid 4242 on host node-17"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_S - 60
    os.utime(lock_file, (old, old))  # its holder stopped refreshing it: that run is gone
    lock = RunLock(tmp_path).acquire()
    try:
        assert lock.took_over["host"] == "node-17"
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_only_the_process_that_owns_the_folder_locks_it(tmp_path, monkeypatch):
    from yamlformer.recipes.training.run_folder import RunLock, claim, owns_run_folder

    assert owns_run_folder({}) and owns_run_folder({"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0"})
    for rank in (
        {"LOCAL_RANK": "1"},
        {"NODE_RANK": "1", "LOCAL_RANK": "0"},
        {"SLURM_PROCID": "3"},
        {"RANK": "5", "SLURM_PROCID": "0"},
    ):
        assert not owns_run_folder(rank), rank
    with RunLock(tmp_path):  # rank 0 holds the folder; rank 1 of the same run goes on untouched
        monkeypatch.setenv("LOCAL_RANK", "1")
        with claim(tmp_path) as out:
            assert out == tmp_path


def _read_only_writes(folder):
    real_open = open

    def guarded(path, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode", "r")
        if str(path).startswith(str(folder)) and any(m in mode for m in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    return guarded


@pytest.mark.parametrize("case", ["output is a file", "output under a file", "cache is a file", "read-only output"])
def test_an_unwritable_folder_stops_the_run_before_any_work(tmp_path, capsys, monkeypatch, case):
    import yamlformer.recipes.training.run_folder
    from yamlformer.builder.cli import main

    out, cache = tmp_path / "out", tmp_path / "cache"
    if case == "output is a file":
        out.write_text("not a folder")
    elif case == "output under a file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "run"
    elif case == "cache is a file":
        cache.write_text("not a folder")
    else:
        monkeypatch.setattr(yamlformer.recipes.training.run_folder, "open", _read_only_writes(out), raising=False)
    recipe = tiny_recipe(tmp_path, data={"cache_dir": str(cache)}, trainer={"output_dir": str(out)})
    assert main(["train", str(recipe), "--no-samples"]) == 1
    line = one_error_line(capsys.readouterr().err, "builder train:")
    field, path = ("data.cache_dir", cache) if case == "cache is a file" else ("trainer.output_dir", out)
    assert line.startswith(f"builder train: {field} {path}"), line
    expected = {
        "output is a file": "is a file, not a folder",
        "output under a file": f"is under {tmp_path / 'file'}",
        "cache is a file": "is a file, not a folder",
        "read-only output": "the filesystem is read-only",
    }
    assert expected[case] in line
    assert not (cache / "tokens").exists()


def test_resume_names_every_field_that_differs_and_fresh_keeps_the_old_checkpoints(tmp_path, capsys):
    from yamlformer.builder.cli import main

    recipe = tiny_recipe(tmp_path, trainer={"max_steps": 2, "output_dir": str(tmp_path / "run")})
    train = ["train", str(recipe), "--no-samples"]
    assert main(train) == 0
    capsys.readouterr()
    changed = [
        "--set",
        "optimizer.lr=0.01",
        "--set",
        "trainer.seed=7",
        "--set",
        "data.batch_size=2",
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        "model.overrides.decoder.n_layers=1",
    ]
    assert main([*train, *changed]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "corpus:" not in out  # refused before the corpus was read
    for line in (
        "  optimizer.lr: 0.003 in the checkpoint, 0.01 now",
        "  trainer.seed: 1337 in the checkpoint, 7 now",
        "  data.batch_size: 4 in the checkpoint, 2 now",
        "  schedule.warmup_steps: 2 in the checkpoint, 5 now",
        "  model.spec.decoder.n_layers: 2 in the checkpoint, 1 now",
    ):
        assert line in err.splitlines(), err[-2000:]
    assert "start over with --fresh, or set trainer.output_dir to a new folder" in err
    assert main([*train, "--set", "trainer.max_steps=3", "--set", "trainer.log_every_n_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "resuming with a changed setting: trainer.max_steps: 2 in the checkpoint, 3 now" in out
    assert main([*train, "--fresh", *changed]) == 0
    out = capsys.readouterr().out
    kept = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoints.before-fresh-")]
    assert len(kept) == 1 and f"--fresh: the earlier checkpoints are kept in {kept[0]}" in out
    import torch

    assert torch.load(kept[0] / "last.ckpt", weights_only=True)["global_step"] == 3


def test_which_recipe_fields_may_change_on_resume():
    from yamlformer.recipes.training.run_folder import recipe_differences

    saved = {
        "model": {"spec": "a.yaml"},
        "trainer": {"max_steps": 10, "seed": 1, "devices": 1},
        "optimizer": {"lr": 0.1},
        "sample": {"prompts": ["a"]},
    }
    now = {
        "model": {"spec": "../a.yaml"},
        "trainer": {"max_steps": 20, "seed": 2, "devices": 2},
        "optimizer": {"lr": 0.1},
        "sample": {"prompts": ["b"]},
    }
    refused, allowed = recipe_differences(saved, now)
    assert [line.split(":")[0] for line in refused] == ["trainer.seed"]
    assert sorted(line.split(":")[0] for line in allowed) == [
        "model.spec",
        "sample.prompts",
        "trainer.devices",
        "trainer.max_steps",
    ]


def test_resume_refuses_a_corpus_whose_text_changed(tmp_path, capsys):
    from yamlformer.builder.cli import main

    text = tmp_path / "corpus.txt"
    words = [f"word{i % 97} " for i in range(4000)]
    text.write_text("".join(words))
    recipe = tiny_recipe(
        tmp_path, data={"sources": [str(text)]}, trainer={"max_steps": 2, "output_dir": str(tmp_path / "run")}
    )
    assert main(["train", str(recipe), "--no-samples"]) == 0
    text.write_text("".join(reversed(words)))  # the same characters, another text
    capsys.readouterr()
    assert main(["train", str(recipe), "--no-samples"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "was trained with a different recipe" in err
    fields = [line for line in err.splitlines() if line.startswith("  ") and line.strip()]
    assert len(fields) == 1 and fields[0].startswith("  data: the corpus text: "), fields


def test_a_spec_field_added_since_the_checkpoint_compares_as_its_default():
    """A checkpoint written before a spec field existed resumes when the field holds its default,
    and is refused, naming the field, when it does not."""
    from yamlformer.builder.spec.loader import load_spec
    from yamlformer.recipes.training.run_folder import spec_differences

    current = load_spec(REPO / "specs" / "tiny" / "llama.yaml").model_dump(mode="json")
    older = json.loads(json.dumps(current))
    for layer_field in ("qk_norm", "sinks", "chunk_size", "rope", "rope_theta", "temperature_tuning"):
        older["decoder"]["attention"].pop(layer_field, None)
    older["decoder"].pop("parallel_residual", None)
    assert older != current
    assert spec_differences(older, current) == []
    changed = json.loads(json.dumps(current))
    changed["decoder"]["attention"]["sinks"] = True
    lines = spec_differences(older, changed)
    assert lines == ["model.spec.decoder.attention.sinks: false in the checkpoint, true now"]
