"""Our import root: the four folders import as ``yamlformer.*`` only, beside other distributions
that use their bare names (Hugging Face's ``kernels``, which ``transformers`` imports); what still
goes wrong is said in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(*args: str, pythonpath: list[Path], cwd: Path = ROOT / "specs", safe: bool = True):
    """``python ARGS`` importing from ``pythonpath`` (and the installed packages); ``safe=False``
    lets Python put ``cwd`` first on its path, as ``python -m`` started in a folder does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    if safe:
        env["PYTHONSAFEPATH"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


def run_cli(*args: str, pythonpath: list[Path], **kwargs) -> subprocess.CompletedProcess:
    return run_python("-m", "yamlformer.builder.cli", *args, pythonpath=pythonpath, **kwargs)


def test_every_package_of_ours_carries_the_mark_and_imports_under_the_root():
    import yamlformer.builder
    from yamlformer.builder.packages import FOLDERS, MARK, NAMES, foreign

    assert tuple(f"yamlformer.{folder}" for folder in FOLDERS) == NAMES
    for folder in FOLDERS:
        assert MARK in (ROOT / folder / "__init__.py").read_text()
    assert foreign() is None
    assert Path(yamlformer.builder.__file__).resolve() == ROOT / "builder" / "__init__.py"


def test_no_module_of_ours_is_imported_by_a_bare_name():
    """Every import in the project names the root: a bare ``import kernels`` would take Hugging
    Face's package (or hide it, run from the checkout)."""
    import re

    bare = re.compile(r"^\s*(?:from|import)\s+(builder|blocks|kernels|recipes)\b", re.M)
    offenders = []
    for folder in ("builder", "blocks", "kernels", "recipes", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if "malformed" in path.parts:
                continue
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in bare.finditer(path.read_text())]
    assert offenders == []


def test_hugging_face_kernels_and_ours_live_in_one_interpreter():
    """The clash that made every fresh install refuse to run: with ``transformers`` (and through it
    Hugging Face's ``kernels``) installed, our commands run and ``import kernels`` is theirs."""
    pytest.importorskip("transformers")
    code = (
        "import importlib.util, sys; import yamlformer.kernels, yamlformer.builder as b; "
        "from yamlformer.builder.packages import foreign; "
        "spec = importlib.util.find_spec('kernels'); "
        "print(foreign(), spec is None or 'site-packages' in spec.origin or 'dist-packages' in spec.origin)"
    )
    done = run_python("-c", code, pythonpath=[], cwd=ROOT, safe=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "True"]
    version = run_cli("--version", pythonpath=[])
    assert version.returncode == 0 and version.stdout.startswith("builder "), version.stderr


def test_a_stray_copy_of_one_of_our_packages_earlier_on_the_path_is_named_in_one_line(tmp_path):
    other = tmp_path / "site"
    (other / "yamlformer" / "kernels").mkdir(parents=True)
    (other / "yamlformer" / "kernels" / "__init__.py").write_text('"""Somebody else\'s files."""\n')
    done = run_cli("validate", str(ROOT / "specs" / "tiny" / "llama.yaml"), pythonpath=[other])
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert (
        "the module `yamlformer.kernels` resolves to" in lines[0] and str(other / "yamlformer" / "kernels") in lines[0]
    )
    assert "pip uninstall yamlformer" in lines[0]


def _other_distribution(site: Path, module: str) -> None:
    """A distribution named ``other-<module>`` that installs the top-level module ``module``."""
    info = site / f"other_{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: other-{module}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{module}\n")


def test_the_checkout_first_on_the_path_hiding_another_kernels_is_named(tmp_path):
    """``python -m`` started in the checkout puts its folders first: a bare ``import kernels``
    would find ours and hide the installed distribution of that name."""
    site = tmp_path / "site"
    _other_distribution(site, "kernels")
    done = run_cli("validate", "specs/tiny/llama.yaml", pythonpath=[site], cwd=ROOT, safe=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "`import kernels` finds this checkout's kernels/ folder" in line and "PYTHONSAFEPATH=1" in line
    done = run_cli("validate", "specs/tiny/llama.yaml", pythonpath=[site], cwd=ROOT, safe=True)
    assert done.returncode == 0, done.stderr
    # with no other distribution of those names, the checkout on the path hides nothing
    done = run_python(
        "-c",
        "import importlib.metadata as m, yamlformer.builder.packages as p; m.packages_distributions = dict; "
        "print(p.foreign())",
        pythonpath=[],
        cwd=ROOT,
        safe=False,
    )
    assert done.stdout.strip() == "None", done.stderr


def test_the_python_api_raises_an_import_error_with_the_same_line(tmp_path, monkeypatch):
    import yamlformer.builder
    from yamlformer.builder import packages

    monkeypatch.setattr(packages, "foreign", lambda: "the module `yamlformer.blocks` resolves to elsewhere")
    with pytest.raises(ImportError, match="`yamlformer.blocks` resolves to elsewhere"):
        yamlformer.builder.load_spec  # noqa: B018


def test_a_pickle_naming_a_module_by_its_old_bare_name_is_refused_with_how_to_convert(tmp_path):
    """Our checkpoints hold tensors and plain values only, so they load across the rename; a pickle
    that names ``builder.spec.schema.Spec`` (our old path) is refused, saying what to do, unrun."""
    from yamlformer.builder.checkpoints.format import CheckpointError
    from yamlformer.builder.checkpoints.read import read_checkpoint
    from yamlformer.builder.hf.common import HFError
    from yamlformer.builder.hf.weights import torch_load_safely

    path = tmp_path / "old.ckpt"
    path.write_bytes(b"\x80\x02cbuilder.spec.schema\nSpec\n)\x81q\x00.")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "`builder.spec.schema.Spec`" in message and "`yamlformer.builder.spec.schema.Spec`" in message
    assert "state_dict" in message and "\n" not in message
    with pytest.raises(HFError, match="yamlformer.builder.spec.schema.Spec"):
        torch_load_safely(path)


def test_a_checkpoint_names_no_module_of_ours(tmp_path):
    """What makes old checkpoints load after the rename: a training checkpoint's pickle refers to
    torch's and the standard library's globals only, none of this project's modules."""
    import io
    import pickletools
    import re
    import zipfile

    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.training.run import run

    recipe = tiny_recipe(tmp_path, trainer={"max_steps": 2, "val_check_interval": 2, "checkpoint_every_n_steps": 2})
    run(recipe, samples=False)
    [checkpoint] = (tmp_path / "run").rglob("last.ckpt")
    with zipfile.ZipFile(checkpoint) as archive:
        [name] = [n for n in archive.namelist() if n.endswith("data.pkl")]
        listing = io.StringIO()
        pickletools.dis(archive.read(name), listing)
    modules = {g.split()[0].split(".")[0] for g in re.findall(r"GLOBAL\s+'([^']+)'", listing.getvalue())}
    assert modules and modules <= {"torch", "collections", "_codecs", "builtins"}


def test_version():
    import yamlformer.builder

    done = run_cli("--version", pythonpath=[])
    assert done.returncode == 0
    assert done.stdout.startswith(f"builder {yamlformer.builder.__version__} (torch ")
    assert "lightning" in done.stdout and "triton" in done.stdout
