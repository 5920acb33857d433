"""The zoo by name: every shipped spec and recipe has a name that resolves from anywhere (a path
that exists wins), `builder list` shows them, `builder cp` copies one that still resolves, and a
built wheel carries them (`builder describe llama3-8b` from an install, not this checkout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yamlformer.builder.cli import main
from yamlformer.builder.cli.validate import validate_any
from yamlformer.builder.spec.loader import load_spec, validate_file
from yamlformer.builder.zoo import entries, find, locate, name_of

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").rglob("*.yaml"))
RECIPE_FILES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_every_shipped_file_has_one_name():
    found = entries()
    assert sorted(e.path for e in found.values()) == sorted([*SPEC_FILES, *RECIPE_FILES])
    assert {e.kind for e in found.values() if e.path in RECIPE_FILES} == {"recipe"}
    assert found["llama3-8b"].path == ROOT / "specs" / "llama3-8b.yaml"
    assert found["tiny/llama"].path == ROOT / "specs" / "tiny" / "llama.yaml"
    assert found["lm-stdlib"].kind == "recipe"
    assert (
        find("llama3-8b.yaml") == found["llama3-8b"] and name_of(ROOT / "specs" / "tiny" / "llama.yaml") == "tiny/llama"
    )


def test_a_name_loads_as_its_file():
    by_name, by_path = load_spec("llama3-8b"), load_spec(ROOT / "specs" / "llama3-8b.yaml")
    assert by_name == by_path and by_name.name == "llama3-8b"
    assert load_spec("tiny/llama", overrides={"decoder.n_layers": 1}).decoder.n_layers == 1


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    (tmp_path / "llama3-8b").write_text("extends: tiny/llama\nname: mine\n")
    monkeypatch.chdir(tmp_path)
    assert load_spec("llama3-8b").name == "mine"  # the file here, which extends the zoo by name
    assert locate("llama3-8b") == Path("llama3-8b")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "llama2-7b.yaml").write_text("extends: tiny/gpt2\nname: sibling\n")
    (tmp_path / "sub" / "child.yaml").write_text("extends: llama2-7b.yaml\n")
    assert load_spec(tmp_path / "sub" / "child.yaml").d_model == load_spec("tiny/gpt2").d_model  # the sibling


def test_extends_and_model_spec_take_names(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: llama3-8b\ndecoder: {n_layers: 2}\n")
    spec = load_spec(mine)
    assert spec.decoder.n_layers == 2 and spec.vocab_size == 128256
    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("model: {spec: tiny/llama, overrides: {decoder.n_layers: 1}}\n")
    assert model_spec(load_recipe(recipe_file), 300).decoder.n_layers == 1


def test_a_name_not_found_gets_the_closest(tmp_path):
    [problem] = validate_file("llama3-8")
    assert problem.message.startswith("no such file, nor a zoo name; did you mean 'llama3-8b'?")
    child = tmp_path / "child.yaml"
    child.write_text("extends: tiny/lama\n")
    [problem] = validate_file(child)
    assert (problem.line, problem.path) == (1, "extends")
    assert "nor a zoo name; did you mean 'tiny/llama'?" in problem.message
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  spec: lama3-8b\n")
    [problem] = validate_any(str(recipe), {})
    assert (problem.line, problem.path) == (2, "model.spec") and "did you mean 'llama3-8b'?" in problem.message


def test_list_shows_every_entry(capsys):
    assert main(["list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(entries())
    assert rows["llama3-8b"]["params"] == 8_030_261_248 and rows["llama3-8b"]["family"] == "llama"
    assert rows["mpt-7b"]["family"] == "mpt"
    assert rows["pythia-160m"]["family"] == "gpt_neox" and rows["olmo2-7b"]["family"] == "olmo2"
    assert rows["qwen3-30b-a3b"]["family"] == "qwen3_moe" and rows["qwen3-0.6b"]["family"] == "qwen3"
    assert rows["translate-multi30k"]["family"] == "translation" and rows["lm-stdlib"]["kind"] == "recipe"
    assert rows["shakespeare-char"]["params_approximate"]  # a char vocabulary is known once the data is read
    assert all(row["description"] and "problem" not in row for row in rows.values()), rows
    assert main(["list", "--kind", "recipe"]) == 0
    table = capsys.readouterr().out
    assert "lm-stdlib" in table and "llama3-8b" not in table


@pytest.mark.parametrize("name", sorted(entries()))
def test_a_copy_validates_where_it_is_copied(name, tmp_path, capsys):
    assert main(["cp", name, str(tmp_path)]) == 0
    copy = tmp_path / find(name).path.name
    assert validate_any(str(copy), {}) == []
    text = copy.read_text()
    assert text.splitlines()[0] == find(name).path.read_text().splitlines()[0]  # comments kept
    if "extends: " in text:  # a relative parent is now a zoo name
        parent = next(line for line in text.splitlines() if line.startswith("extends: ")).split()[1]
        assert find(parent) is not None, parent


def test_cp_rewrites_a_relative_extends_and_refuses_to_overwrite(tmp_path, capsys):
    target = tmp_path / "my.yaml"
    assert main(["cp", "tiny/llama", str(target)]) == 0
    assert "extends: ../llama2-7b.yaml -> llama2-7b" in capsys.readouterr().out
    assert "extends: llama2-7b\n" in target.read_text()
    assert main(["cp", "tiny/llama", str(target)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["cp", "llama3-8b", str(target), "--force"]) == 0
    assert main(["cp", "lama3-8b", str(tmp_path / "x.yaml")]) == 1
    assert "did you mean 'llama3-8b'?" in capsys.readouterr().err
    assert main(["cp", "llama3-8b", str(tmp_path / "missing" / "x.yaml")]) == 1


def test_a_wheel_carries_the_zoo(tmp_path):
    """Build the wheel, install it into a folder of its own and run the CLI from there (the
    repository not importable): names resolve to the installed copies."""
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the `wheel` package
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # built from a copy: a build in the checkout leaves its egg-info there, whose entry points
    # (commands, document kinds) then shadow the installed ones for whatever runs from the checkout
    source = tmp_path / "source"
    for name in ("builder", "blocks", "kernels", "recipes", "specs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env["PYTHONPATH"] = str(target)
    work = tmp_path / "work"
    work.mkdir()

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "yamlformer.builder.cli", *args], capture_output=True, text=True, env=env, cwd=work
        )

    where = subprocess.run(
        [sys.executable, "-c", "import yamlformer.builder.zoo as z; print(z.spec_folder())"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    assert where.stdout.strip() == str(target / "yamlformer" / "builder" / "zoo" / "specs"), where.stderr
    described = cli("describe", "llama3-8b", "--json")
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout)["params"]["total"] == 8_030_261_248
    listed = cli("list", "--json")
    assert {row["name"] for row in json.loads(listed.stdout)} == set(entries())
    checked = cli("validate", "bert-mlm", "translate-multi30k", "tiny/llama")
    assert checked.returncode == 0 and checked.stdout.strip() == "3 files ok", checked.stdout + checked.stderr
    copied = cli("cp", "mistral-7b", "mine.yaml")
    assert copied.returncode == 0 and "extends: llama2-7b\n" in (work / "mine.yaml").read_text()
    assert cli("validate", "mine.yaml").returncode == 0
