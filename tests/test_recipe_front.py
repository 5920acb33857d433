"""Recipes are first-class: `builder validate` takes specs and recipes (told apart by content), a
spec where a recipe is wanted (or the reverse) is one line that says what to do, `--set
decoder.n_layers=2` on a recipe sets the model, a `--set` path is read from the working
directory, and `builder train RECIPE --dry-run` resolves everything without running anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import data_for_recipes
from test_shipped_recipes import BASES

from yamlformer.builder.cli import main
from yamlformer.builder.kinds import kind_of
from yamlformer.builder.spec.loader import SpecError, load_spec
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import model_spec
from yamlformer.recipes.tasks import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted([*(ROOT / "specs").rglob("*.yaml"), *(ROOT / "recipes").glob("*.yaml")])


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_validate_checks_every_shipped_spec_and_recipe():
    run = cli("validate", *[str(p.relative_to(ROOT)) for p in SHIPPED])
    assert run.returncode == 0 and run.stdout.strip() == f"{len(SHIPPED)} files ok", run.stdout + run.stderr


def test_a_recipe_is_validated_with_its_model(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  spec: tiny/llama\n  overrides:\n    decoder: {n_layer: 1}\ntrainer: {max_step: 3}\n")
    assert main(["validate", str(recipe)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"{recipe}:5:11: trainer.max_step: unknown key 'max_step'; did you mean 'max_steps'?"
    recipe.write_text("model:\n  spec: tiny/llama\n  overrides:\n    decoder: {n_layer: 1}\n")
    assert main(["validate", str(recipe)]) == 1
    assert capsys.readouterr().out.startswith(f"{recipe}:4:15: decoder.n_layer: unknown key 'n_layer'")


def test_a_path_with_a_line_break_is_one_located_line(tmp_path, capsys):
    """A data path with a newline split its message over three lines with no line:col."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text('model: {spec: tiny/llama}\ndata:\n  sources:\n    - "corpus\\nbooks"\n')
    assert main(["train", str(recipe), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"{recipe}:4:7: data.sources.0.path: 'corpus\\nbooks' holds a line break or another control character; "
        "a path is one line\n"
    )


def test_a_warmup_longer_than_the_run_is_said_by_the_dry_run_and_the_run(tmp_path, capsys, monkeypatch):
    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.training import run as training

    recipe = tiny_recipe(tmp_path, schedule={"warmup_steps": 100}, trainer={"max_steps": 12})
    warning = "schedule.warmup_steps 100 is more than trainer.max_steps 12: the learning rate never reaches"
    assert main(["train", str(recipe), "--dry-run"]) == 0
    assert f"warning    {warning}" in capsys.readouterr().out

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(training, "run_session", started)  # stop where the run's work would begin
    with pytest.raises(Started):
        training.run(recipe, samples=False)
    assert f"warning: {warning}" in capsys.readouterr().out
    tiny_recipe(tmp_path, schedule={"warmup_steps": 12}, trainer={"max_steps": 12})
    assert main(["train", str(recipe), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_kinds_are_told_apart_by_content():
    from yamlformer.builder.spec.source import read_document

    assert kind_of(read_document(ROOT / "specs" / "gpt2-small.yaml").data).name == "spec"
    assert kind_of(read_document(ROOT / "recipes" / "bert-mlm.yaml").data).name == "recipe"
    assert kind_of({"name": "x"}) is None and kind_of([1]) is None


@pytest.mark.parametrize(
    "command", [["describe"], ["compare"], ["plan", "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", "8"]]
)
def test_a_recipe_given_for_a_spec_is_one_line(command):
    run = cli(command[0], "recipes/lm-stdlib.yaml", *command[1:])
    assert run.returncode == 1
    [line] = (run.stdout + run.stderr).strip().splitlines()
    assert line.startswith("recipes/lm-stdlib.yaml: this is a training recipe, not a model spec: ")
    assert "`builder train lm-stdlib --dry-run`" in line  # the zoo name, which works from anywhere


def test_a_spec_given_for_a_recipe_is_one_line():
    run = cli("train", "llama3-8b")
    assert run.returncode == 1 and not run.stdout
    [line] = run.stderr.strip().splitlines()
    assert "this is a model spec, not a training recipe" in line
    assert "builder train lm-stdlib --set model.spec=llama3-8b" in line
    with pytest.raises(SpecError, match="this is a training recipe"):
        load_spec(ROOT / "recipes" / "classify.yaml")


def test_set_on_a_recipe_reaches_the_spec_by_its_short_form():
    short = load_recipe("lm-stdlib", {"decoder.n_layers": 2, "d_model": 96, "trainer.max_steps": 5, "name": "x"})
    long = load_recipe(
        "lm-stdlib",
        {"model.overrides.decoder.n_layers": 2, "model.overrides.d_model": 96, "trainer.max_steps": 5, "name": "x"},
    )
    assert short.recipe == long.recipe and short.recipe.name == "x"  # `name` stays the recipe's
    spec = model_spec(short, 512)
    assert (spec.decoder.n_layers, spec.d_model, spec.vocab_size) == (2, 96, 512)
    with pytest.raises(SpecError) as info:
        model_spec(load_recipe("lm-stdlib", {"decoder.n_layer": 2}), 512)
    [problem] = info.value.problems
    assert problem.file == "<--set decoder.n_layer=2>" and "did you mean 'n_layers'?" in problem.message
    with pytest.raises(SpecError, match="unknown key 'n_layers'"):  # neither a recipe section nor a spec field
        load_recipe("lm-stdlib", {"n_layers": 2})


def test_a_set_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("extends: tiny/llama\nname: mine\n")
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("lm-stdlib", {"model.spec": "mine.yaml"})
    assert recipe.recipe.model.spec == str(tmp_path / "mine.yaml")
    assert model_spec(recipe, 256).name == "mine"
    assert load_recipe("lm-stdlib", {"model.spec": "tiny/gpt2"}).recipe.model.spec == "tiny/gpt2"  # a name stays a name
    with pytest.raises(SpecError) as info:
        model_spec(load_recipe("lm-stdlib", {"model.spec": "nothing.yaml"}), 256)
    [problem] = info.value.problems
    assert problem.file == "<--set model.spec=nothing.yaml>" and "no such file" in problem.message


def test_every_help_example_of_set_works(capsys):
    """The forms the help texts show are forms that work."""
    import re

    from yamlformer.builder.cli import parser

    texts = []
    for action in parser()._subparsers._group_actions:
        for name, sub in action.choices.items():
            texts.append((name, " ".join(sub.format_help().split())))
    examples = {(name, m) for name, text in texts for m in re.findall(r"--set ([a-z][\w.]*=[^\s);,]+)", text)}
    assert ("train", "decoder.n_layers=2") in examples and ("describe", "decoder.n_layers=2") in examples
    for name, example in examples:
        key, _, value = example.partition("=")
        if name in ("train",):
            assert main(["validate", "lm-stdlib", "--set", example]) == 0, example
        elif name in ("validate", "describe", "compare", "diff", "plan", "schema", "export-hf"):
            assert main(["validate", "tiny/llama", "--set", example]) == 0, example
    capsys.readouterr()


def test_dry_run_resolves_without_downloading_or_writing(tmp_path):
    """A clean machine: no data, no cache, no network. The dry run says what it would fetch and
    prints the estimate; it writes nothing."""
    env = {**__import__("os").environ, "BUILDER_DATA": str(tmp_path / "data")}
    run = cli("train", "shakespeare-char", "--dry-run", "--set", "decoder.n_layers=2", cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("# ") and "\ntrainer:\n  max_steps: 2000\n" in out  # the resolved recipe
    assert "would download https://raw.githubusercontent.com/karpathy/char-rnn/" in out
    assert "overrides  decoder.n_layers=2" in out and "char: the corpus's distinct characters" in out
    assert "nanogpt-shakespeare-char: decoder-only" in out and "training total" in out  # the estimate table
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing downloaded, cached or written
    assert "downloading" not in run.stderr


def test_dry_run_reads_what_is_on_disk(tmp_path, monkeypatch, capsys):
    from yamlformer.recipes.training.dry_run import dry_run

    data_for_recipes(tmp_path / "data", monkeypatch)
    monkeypatch.chdir(tmp_path)
    result = dry_run("shakespeare-char")
    out = capsys.readouterr().out
    assert "(on disk)" in out and "would download" not in out
    text = (tmp_path / "data" / "tinyshakespeare.txt").read_text()
    assert result["vocab_size"] == len(set(text)) + 1 == result["spec"]["vocab_size"]  # and end-of-text
    translation = dry_run("translate-multi30k", {"trainer.devices": 1})
    assert translation["spec"]["architecture"] == "encoder-decoder" and len(translation["data"]) == 4
    assert "longest batch of data.max_tokens" in capsys.readouterr().out
    assert not (tmp_path / ".cache").exists() and not (tmp_path / "runs").exists()


def test_dry_run_of_every_shipped_recipe(tmp_path, monkeypatch, capsys):
    from yamlformer.recipes.training.dry_run import dry_run

    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        if path.stem in BASES:  # starts from another recipe's run, not trained here: refused, as the run refuses it
            with pytest.raises(RecipeError, match="is a recipe, and its run has no checkpoint"):
                dry_run(path.stem)
            continue
        result = dry_run(path.stem)
        assert result["params"] > 0 and (result["recipe"]["model"]["spec"] or result["recipe"]["model"]["init_from"])
    assert list(tmp_path.iterdir()) == []
    capsys.readouterr()


def test_a_recipe_from_an_untrained_recipe_validates_but_run_and_dry_run_refuse_it(tmp_path, monkeypatch, capsys):
    """``model.init_from: lm-stdlib`` before lm-stdlib was trained: the file is valid (validate checks
    it with lm-stdlib's spec and vocabulary), but the run refuses it, and so does its dry run, with
    the same line, nothing written."""
    from yamlformer.recipes.training.dry_run import dry_run
    from yamlformer.recipes.training.run import run

    monkeypatch.setenv("BUILDER_DATA", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "lora-stdlib"]) == 0
    capsys.readouterr()
    refusals = []
    for attempt in (lambda: dry_run("lora-stdlib"), lambda: run("lora-stdlib")):
        with pytest.raises(RecipeError) as caught:
            attempt()
        refusals.append(str(caught.value))
    assert refusals[0] == refusals[1] and "train it first (builder train lm-stdlib)" in refusals[0], refusals
    assert list(tmp_path.iterdir()) == []


def test_dry_run_errors_are_one_line():
    run = cli("train", "lm-stdlib", "--dry-run", "--set", "model.spec=tiny/llama")
    assert run.returncode == 1
    assert run.stderr.strip() == (
        "builder train: data.seq_len 128 is longer than the model's max_seq_len 64; "
        "lower data.seq_len or set model.overrides.max_seq_len"
    )
    run = cli("train", "lm-stdlb", "--dry-run")
    assert run.returncode == 1 and "did you mean 'lm-stdlib'?" in run.stderr and len(run.stderr.splitlines()) == 1


def test_validate_and_dry_run_refuse_files_that_are_not_there(tmp_path, capsys):
    """A data folder or init_from that does not exist is named (field, the path tried, a close
    name beside it) by `validate` and `--dry-run`, exit 1 — before any run (a missing
    tokenizer.model_file is refused when the recipe loads)."""
    from recipe_helpers import tiny_recipe

    (tmp_path / "corpus").mkdir()
    recipe = tiny_recipe(tmp_path, data={"sources": [str(tmp_path / "corpsu")]})
    assert main(["validate", str(recipe)]) == 1
    out = capsys.readouterr().out
    missing = f"data.sources.0: no such file or folder {tmp_path / 'corpsu'}; did you mean '{tmp_path / 'corpus'}'?"
    assert f"{recipe}:23:5: {missing}" in out  # at the line that names it
    assert main(["train", str(recipe), "--dry-run"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"{recipe}:23:5: {missing}"
    recipe = tiny_recipe(tmp_path, model={"init_from": str(tmp_path / "run" / "last.ckpt")})
    assert main(["train", str(recipe), "--dry-run"]) == 1
    assert "model.init_from: no such file or folder" in capsys.readouterr().err


# -- trainer.devices: read once, counted once --------------------------------------------------------


@pytest.mark.parametrize(
    "written, read",
    [(3, 3), ("3", 3), (" 3 ", 3), ("auto", "auto"), (-1, -1), ("-1", -1)]
    + [("[0, 1]", [0, 1]), ("0,1", [0, 1]), ("1,", [1]), ([0, 1], [0, 1])],
)
def test_devices_are_read_once_as_lightning_reads_them(written, read):
    from yamlformer.recipes.recipe.sections import TrainerSection

    assert TrainerSection(devices=written).devices == read


@pytest.mark.parametrize("written", ["two", 0, "0", -2, [], [0, 0], "[0, 1", 1.5, True])
def test_a_bad_devices_value_is_one_located_line(written, tmp_path, capsys):
    from recipe_helpers import tiny_recipe

    path = tiny_recipe(tmp_path, trainer={"devices": written})
    assert main(["train", str(path), "--dry-run"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{path}:" in line and "trainer.devices" in line and "Traceback" not in line


@pytest.mark.parametrize("cuda", [False, True])
def test_devices_mean_one_count_in_training_and_in_the_dry_run(cuda, monkeypatch):
    """``devices: "3"`` and ``"[0, 1]"`` are 3 and 2 processes per node for training's layout, the
    dry run's devices line and the data ranks alike (on a machine with 4 CUDA devices, and on the
    CPU, where device indices are refused by training in one line and flagged by the dry run)."""
    import torch

    from yamlformer.builder.spec.loader import load_spec
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.parallel import layout_of
    from yamlformer.recipes.recipe.sections import Recipe
    from yamlformer.recipes.training.dry_run import data_parallel_ranks, devices_line, recipe_estimate

    if cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    accelerator = "cuda" if cuda else "cpu"
    for written, count in [("3", 3), ("[0, 1]", 2), ("0,1", 2)]:
        for strategy in ("ddp", "fsdp"):
            trainer = {"accelerator": accelerator, "devices": written, "strategy": strategy, "precision": "32"}
            recipe = Recipe.model_validate({"model": {"spec": "tiny/llama"}, "trainer": trainer})
            line = devices_line(recipe)
            assert line.startswith(f"{accelerator} x {count}, "), line
            assert data_parallel_ranks(recipe) == count
            assert recipe_estimate(load_spec("tiny/llama"), recipe, 16, 1).settings["devices"] == count
            if cuda or written == "3":
                assert layout_of(recipe.trainer).devices == count and "WARNING" not in line
            else:
                with pytest.raises(RecipeError, match="on the CPU each device is a process"):
                    layout_of(recipe.trainer)
                assert "WARNING: trainer.devices [0, 1]: on the CPU" in line and "train refuses this" in line
