"""A recipe is resolved once (yamlformer.recipes.training.resolved): a run resolves its model spec
one time, with the tokenizer's real vocabulary, and hands that resolution to every stage; and
``builder train --dry-run`` goes through the same resolution and checks as the run, so for each
way a recipe can be wrong the dry run and the run give the same verdict."""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import string
import zipfile

import pytest
import yaml
from recipe_helpers import tiny_recipe

from yamlformer.builder.cli import main


class Reached(BaseException):
    """The run got past everything before its first step (its Trainer was about to be made)."""


@pytest.fixture
def stops_before_training(monkeypatch):
    import yamlformer.recipes.training.run

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(yamlformer.recipes.training.run, "run_trainer", reached)


def _verdicts(capsys, recipe, *extra) -> tuple[tuple, tuple]:
    """``(dry run, run)``, each ``(exit status, its stderr)``; a run that reaches training counts 0."""
    capsys.readouterr()
    dry = main(["train", str(recipe), "--dry-run", *extra]), capsys.readouterr().err.strip()
    try:
        status = main(["train", str(recipe), "--no-samples", *extra])
    except Reached:
        status = 0
    return dry, (status, capsys.readouterr().err.strip())


def _tokenized(folder, validation_tokens: int):
    """A ``builder tokenize`` output (char tokenizer) whose validation split holds
    ``validation_tokens`` tokens."""
    from yamlformer.recipes.data.sources import Document
    from yamlformer.recipes.data.tokenize import tokenize_documents
    from yamlformer.recipes.data.tokenizers import CharTokenizer

    train = [Document(f"def f{i}(x):\n    return x + {i}\n" * 20, "train", "a") for i in range(20)]
    held = [Document("y" * (validation_tokens - 1), "validation", "b")]  # and end-of-text
    tokenizer = CharTokenizer.fit(string.printable, eos=True)
    tokenize_documents(train + held, tokenizer, folder, progress=False)
    return folder


def _zip_bomb(path):
    """A zip archive named like a checkpoint whose one member inflates 1000-fold."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("archive/data.pkl", "w") as f:
        for _ in range(16):
            f.write(bytes(1 << 20))
    return path


def _cases(tmp_path) -> dict:
    """Recipe sections that make a recipe the run refuses, by what is wrong."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "random.ckpt").write_bytes(os.urandom(4096))
    (tmp_path / "notes.txt").write_text("not a model\n" * 50)
    with open(tmp_path / "objects.pkl", "wb") as f:
        pickle.dump({"step": 3, "callback": os.getcwd}, f)
    (tmp_path / "empty").mkdir()
    data = {"seq_len": 32, "batch_size": 4, "cache_dir": str(tmp_path / "cache")}
    trained = {"type": "sentencepiece", "vocab_size": 300}  # its vocabulary is known without reading the text
    return {
        "a device that never ends": {"data": {**data, "sources": ["/dev/zero"]}, "tokenizer": trained},
        "a pipe": {"data": {**data, "sources": [str(fifo)]}, "tokenizer": trained},
        "random bytes as a device": {"data": {**data, "sources": ["/dev/urandom"]}, "tokenizer": trained},
        "init_from random bytes": {"model": {"init_from": str(tmp_path / "random.ckpt")}},
        "init_from a text file": {"model": {"init_from": str(tmp_path / "notes.txt")}},
        "init_from a pickle": {"model": {"init_from": str(tmp_path / "objects.pkl")}},
        "init_from an empty folder": {"model": {"init_from": str(tmp_path / "empty")}},
        "init_from a zip bomb": {"model": {"init_from": str(_zip_bomb(tmp_path / "bomb.ckpt"))}},
        "a validation split shorter than a window": {
            "data": {**data, "sources": [str(_tokenized(tmp_path / "short.tok", validation_tokens=20))]}
        },
    }


def test_the_dry_run_and_the_run_refuse_the_same_recipes(tmp_path, capsys, stops_before_training):
    differ = {}
    for case, sections in _cases(tmp_path).items():
        folder = tmp_path / case.replace(" ", "-")
        folder.mkdir()
        dry, run = _verdicts(capsys, tiny_recipe(folder, **sections))
        if dry != run:
            differ[case] = (dry, run)
            continue
        # one line: the run's refusal, or a file's, located at the recipe's line that names it
        said = dry[1].startswith(("builder train: ", f"{folder / 'recipe.yaml'}:"))
        assert dry[0] == 1 and said and len(dry[1].splitlines()) == 1, (case, dry)
    assert not differ, differ


def test_a_run_from_init_from_alone_and_a_resume_of_another_model_agree(tmp_path, capsys, stops_before_training):
    """``model.init_from`` with no ``model.spec``: both take the weights' spec (the dry run blamed a
    ``--set model.spec=None`` nobody typed); a folder whose checkpoint is of another model: both
    refuse to resume it (the dry run said it would resume)."""
    from hostile_helpers import lm_checkpoint

    weights = lm_checkpoint(tmp_path / "weights")
    for folder in ("alone", "wider"):
        (tmp_path / folder).mkdir()
    alone = tiny_recipe(tmp_path / "alone", model={"spec": None, "init_from": str(weights)})
    dry, run = _verdicts(capsys, alone)
    assert dry == run == (0, "")
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.ckpt").write_bytes(weights.read_bytes())
    wider = tiny_recipe(tmp_path / "wider", trainer={"output_dir": str(out)})
    written = yaml.safe_load(wider.read_text())
    written["model"]["spec"]["decoder"]["n_layers"] = 3
    wider.write_text(yaml.safe_dump(written))
    dry, run = _verdicts(capsys, wider)
    assert dry == run and dry[0] == 1, (dry, run)
    assert "was trained with a different recipe" in dry[1] and "decoder.n_layers: 2 in the checkpoint, 3 now" in dry[1]


def test_builder_train_lm_stdlib_resolves_its_spec_once(tmp_path, monkeypatch, capsys):
    """From the command line to the last checkpoint, a new run and the run that resumes it: each
    validates the model spec one time, with the vocabulary its tokenizer then has (a resume used
    to resolve it once more to compare it with the checkpoint's)."""
    import sys

    from test_shipped_recipes import TINY, TRAINER

    import yamlformer.builder.spec.loader as loader
    import yamlformer.recipes.recipe.sections as sections
    from yamlformer.builder.checkpoints import read_meta
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.data.tokenizers import from_state

    counts: collections.Counter = collections.Counter()
    model_spec, validate_document = sections.model_spec, loader.validate_document

    def counted_model_spec(*args, **kwargs):
        counts["model_spec"] += 1
        return model_spec(*args, **kwargs)

    def counted_validation(doc, model_cls, *args, **kwargs):
        counts["spec validations"] += model_cls is spec_model()
        return validate_document(doc, model_cls, *args, **kwargs)

    for module in list(sys.modules.values()):  # every module that took the function by name
        if getattr(module, "model_spec", None) is model_spec:
            monkeypatch.setattr(module, "model_spec", counted_model_spec)
        if getattr(module, "validate_document", None) is validate_document:
            monkeypatch.setattr(module, "validate_document", counted_validation)
    spec_sets, recipe_sets = TINY["lm-stdlib"]
    settings = {
        **TRAINER,
        **recipe_sets,
        **{f"model.overrides.{k}": v for k, v in spec_sets.items()},
        "trainer.val_check_interval": 1,
        "trainer.limit_val_batches": 1,
        "trainer.precision": "32",
        "trainer.output_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.max_bytes": 30_000,
    }
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={yaml.safe_dump(value).strip()}")]
    sets = [s.removesuffix("\n...") for s in sets]
    for steps in (1, 2):  # a new run, then the same command resuming it
        counts.clear()
        status = main(["train", "lm-stdlib", "--no-samples", *sets, "--set", f"trainer.max_steps={steps}"])
        assert status == 0, capsys.readouterr().err[-2000:]
        assert counts == {"model_spec": 1, "spec validations": 1}, steps
    meta = read_meta(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert meta["global_step"] == 2
    assert meta["builder"]["spec"]["vocab_size"] == from_state(meta["builder"]["tokenizer"]).vocab_size == 500


@pytest.fixture
def resolutions(monkeypatch):
    """How many times ``model.init_from`` is resolved to a source (a spy around the real
    :func:`yamlformer.builder.init_from.source_at`, which it still calls)."""
    from yamlformer.recipes.recipe import init_from as recipe_init_from

    calls = []
    real = recipe_init_from.source_at

    def counted(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(recipe_init_from, "source_at", counted)
    return calls


def test_model_init_from_is_resolved_once_per_run_and_per_dry_run(tmp_path, resolutions, capsys):
    from yamlformer.recipes.training.dry_run import dry_run
    from yamlformer.recipes.training.run import run

    first = tmp_path / "first"
    first.mkdir()
    summary = run(tiny_recipe(first, trainer={"max_steps": 2, "val_check_interval": 2}), samples=False)
    assert resolutions == []  # no init_from: nothing resolved
    second = tmp_path / "second"
    second.mkdir()
    recipe = tiny_recipe(
        second,
        model={"spec": None, "init_from": summary["last"], "freeze": ["decoder.layers.0"]},
        trainer={"max_steps": 2, "val_check_interval": 2},
    )
    dry_run(recipe)
    assert len(resolutions) == 1, resolutions
    resolutions.clear()
    started = run(recipe, samples=False)
    assert started["steps"] == 2
    assert len(resolutions) == 1, resolutions
    assert "frozen:" in capsys.readouterr().out


def test_what_the_checkpoint_readers_memo_still_saves(tmp_path, monkeypatch):
    """Of the three memos keyed on file fingerprints that a run leaned on, two are gone: the
    ``model.init_from`` source lives in the ``Run`` (above), and the recipe as written in the
    loaded recipe. The third, the checkpoint reader's (``yamlformer.builder.checkpoints.read``),
    stays for what no resolution owns: the checkpoint a run resumes is asked for by the recipe
    comparison before any work, the choice of the newest intact checkpoint, its checks against
    this run and Lightning's restore. Without the memo that is five loads of the file and two
    verifications; with it, one of each
    (``tests/test_recipe_resume.py::test_a_resumed_run_reads_its_checkpoint_once``)."""
    from test_checkpoints import reads_until_training

    import yamlformer.builder.checkpoints.read as read
    from yamlformer.recipes.training.run import run

    trainer = {"max_steps": 2, "checkpoint_every_n_steps": 2, "val_check_interval": 100, "limit_val_batches": 1}
    run(tiny_recipe(tmp_path, trainer=trainer), samples=False)
    monkeypatch.setattr(read, "_recall", lambda path: None)  # every read loads the file again
    reads = reads_until_training(monkeypatch)
    assert run(tiny_recipe(tmp_path, trainer=dict(trainer, max_steps=3)), samples=False)["steps"] == 3
    last = str((tmp_path / "run" / "checkpoints" / "last.ckpt").resolve())
    assert (reads[("load", last)], reads[("verify", last)]) == (5, 2), dict(reads)


@pytest.fixture
def task_answers(monkeypatch):
    """How often a task is asked about a recipe (:meth:`Task.resolve`) and how often its files are
    listed (:meth:`Resolution.add_files`): spies around the real methods, which they still call."""
    from yamlformer.recipes.tasks.lm import CorpusResolution
    from yamlformer.recipes.tasks.task import Task

    counts: collections.Counter = collections.Counter()
    resolve, add_files = Task.resolve, CorpusResolution.add_files

    def counted_resolve(self, located, read_data=True):
        counts["resolve"] += 1
        return resolve(self, located, read_data)

    def counted_files(self, files):
        counts["files"] += 1
        return add_files(self, files)

    monkeypatch.setattr(Task, "resolve", counted_resolve)
    monkeypatch.setattr(CorpusResolution, "add_files", counted_files)
    return counts


def test_a_task_is_asked_once_per_run_dry_run_and_validate(tmp_path, capsys, task_answers, stops_before_training):
    """One :class:`~yamlformer.recipes.tasks.task.Resolution` per resolution, its files listed
    once (the vocabulary, the file checks and the data checks read the same list), and the run's
    ``Run`` holds it. The char tokenizer reads the corpus, so the data is read as a run reads it."""
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.tasks.lm import LMResolution
    from yamlformer.recipes.training.resolved import resolve_run

    recipe = tiny_recipe(tmp_path)
    for command in (["train", str(recipe), "--dry-run"], ["validate", str(recipe)]):
        task_answers.clear()
        assert main(command) == 0, capsys.readouterr().err
        assert task_answers == {"resolve": 1, "files": 1}, command
    task_answers.clear()
    with pytest.raises(Reached):
        main(["train", str(recipe), "--no-samples"])
    assert task_answers == {"resolve": 1, "files": 1}
    task_answers.clear()
    run = resolve_run(load_recipe(recipe))
    assert isinstance(run.resolution, LMResolution) and run.task is run.resolution.task
    assert run.files is run.resolution.files and run.resolution.located is run.located
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.resolution.read_data = False


def test_validate_list_and_the_dry_run_read_the_resolution(tmp_path, capsys, monkeypatch):
    """What the dry run prints of the task and what validate and list refuse come from the task's
    Resolution, not from the task asked again: a resolution that says other things is what they say."""
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.tasks.lm import LMResolution

    recipe = tiny_recipe(tmp_path)
    monkeypatch.setattr(LMResolution, "dry_run_lines", (("note", "said by the resolution"),))
    assert main(["train", str(recipe), "--dry-run"]) == 0
    assert "note       said by the resolution" in capsys.readouterr().out

    def refuse(self, spec):
        raise RecipeError(f"refused by the resolution of {self.located.file.name} ({spec.name})")

    monkeypatch.setattr(LMResolution, "check_spec", refuse)
    assert main(["validate", str(recipe)]) == 1
    assert "refused by the resolution of recipe.yaml (tiny-decoder)" in capsys.readouterr().out
    assert main(["train", str(recipe), "--dry-run"]) == 1
    assert "refused by the resolution of recipe.yaml (tiny-decoder)" in capsys.readouterr().err
