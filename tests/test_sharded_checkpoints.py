"""Sharded checkpoints (``trainer.strategy: fsdp``): a save killed at any moment leaves a whole
checkpoint and nothing that blocks the next save; a damaged shard is a one-line error naming it,
and a resume falls back to the newest intact checkpoint; a run resumes on other layouts and
continues like an unbroken one; the readers (eval, generate, export-hf, consolidate) take a
sharded checkpoint whole.

The default run writes real sharded folders in this process (``yamlformer.builder.checkpoints.save_sharded``,
the sequence every rank of ``ShardedStrategy`` runs, with one rank); the multi-process runs on
CPU processes (gloo) are ``slow``."""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from sharded_helpers import EVEN_VOCAB, assert_same_losses, losses, recipe, train, train_paused_in_save

torch.set_num_threads(1)
#: DCP in one process (no process group) says it assumes one process: it is
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: a Llama layout (GQA, GLU, RMSNorm, RoPE, untied head) whose heads, KV heads and FFN width all
#: split in two, so it runs under TP 2 (with ``EVEN_VOCAB``: the char vocabulary of the tiny corpus
#: is 95) and exports to HF
SPEC = {
    "name": "tiny-llama",
    "architecture": "decoder-only",
    "d_model": 32,
    "max_seq_len": 32,
    "position": {"type": "rope"},
    "tie_embeddings": False,
    "decoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4, "n_kv_heads": 2},
        "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 64},
        "norm": {"type": "rmsnorm"},
    },
}


def _main(*args: str) -> int:
    from yamlformer.builder.cli import main

    return main(list(args))


def _one_line(capsys, *needles: str) -> str:
    """The one line a refusal printed to stderr (progress bars left out), holding ``needles``."""
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    err = "\n".join(lines)
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# -- sharded folders written in this process ------------------------------------------------------------


@functools.cache
def _model(seed: int):
    from yamlformer.builder import build_model
    from yamlformer.builder.spec.schema import spec_model

    spec = spec_model().model_validate(dict(SPEC, vocab_size=96))
    return build_model(spec, init_seed=seed), spec.model_dump(mode="json")


def _save(path: Path, step: int, tag: str | None = None, **builder) -> dict:
    """A sharded checkpoint of step ``step`` at ``path`` (its weights drawn with seed ``step``),
    written the way each rank of the sharded strategy writes one; the weights it holds."""
    from yamlformer.builder.checkpoints import save_sharded

    model, spec = _model(step)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = {
        "global_step": step,
        "builder": {"spec": spec, **builder},
        "state_dict": {f"model.{k}": v for k, v in weights.items()},
    }
    tmp = path.with_name(f".{path.name}.tmp-{tag or f'{step:04d}'}")
    save_sharded(checkpoint, path, tmp, rank=0, ranks=1, barrier=lambda: None)
    return weights


def _assert_holds(path: Path, weights: dict) -> None:
    from yamlformer.builder.checkpoints import load_model

    model, _ = load_model(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), (path, name)


def _debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


class _Died(BaseException):
    """A process that stops at this instant (nothing after it runs, no cleanup)."""


def _resume(run: Path):
    from yamlformer.recipes.training.run import resume_path

    return resume_path(run, resume=None, fresh=False)


def test_a_save_that_dies_at_any_step_leaves_a_whole_checkpoint_and_the_next_save_goes_through(tmp_path, monkeypatch):
    """Every rename and removal a save makes (and its shard and metadata writes) is a point a
    process can die at: at each, the next run resumes from a whole checkpoint of the old or the
    new step, and its own save leaves ``last.ckpt`` and ``last-1.ckpt`` and no debris."""
    import yamlformer.builder.checkpoints.write as sc

    real = {"replace": os.replace, "remove": sc._remove, "digests": sc.write_digests, "meta": sc.write_meta}
    point = -1
    dying = {"at": None}

    def mortal(name):
        def call(*args, **kwargs):
            nonlocal point
            point += 1
            if point == dying["at"]:
                if name == "remove" and Path(args[0]).is_dir():  # dies half-way through removing a folder
                    for file in list(Path(args[0]).iterdir())[:1]:
                        file.unlink()
                raise _Died(name)
            return real[name](*args, **kwargs)

        return call

    monkeypatch.setattr(sc.os, "replace", mortal("replace"))
    for name in ("remove", "digests", "meta"):
        monkeypatch.setattr(
            sc, {"remove": "_remove", "digests": "write_digests", "meta": "write_meta"}[name], mortal(name)
        )
    cases = 0
    # no checkpoint yet; last.ckpt only; last.ckpt and last-1.ckpt; the same step saved again
    for before, new in (((), 20), ((5,), 20), ((5, 10), 20), ((5, 10), 10)):
        at = 0
        while True:
            run = tmp_path / f"{len(before)}-{new}-{at}"
            folder = run / "checkpoints"
            folder.mkdir(parents=True)
            dying["at"] = None
            saved = {step: _save(folder / "last.ckpt", step) for step in before}
            saved[new] = _model(new)[0].state_dict()
            point, dying["at"] = -1, at
            try:
                _save(folder / "last.ckpt", new, tag="new")
            except _Died:
                pass
            else:
                break  # a save with no point left to die at
            finally:
                dying["at"] = None
            cases += 1
            resumed = _resume(run)
            if not before:
                assert resumed is None or resumed.name == "last.ckpt", (at, resumed)
            else:
                assert resumed is not None, f"dying at point {at} lost every checkpoint"
            if resumed is not None:  # what the next run resumes from is whole: the old step or the new
                from yamlformer.builder.checkpoints import read_meta

                step = read_meta(resumed)["global_step"]
                assert step in (*before, new) and step >= max(before, default=0), (at, step)
                _assert_holds(resumed, saved[step])
            # the next save goes through, and the checkpoint resumed from becomes its predecessor
            _save(folder / "last.ckpt", 30)
            assert _debris(folder) == [], (at, _debris(folder))
            _assert_holds(folder / "last.ckpt", _model(30)[0].state_dict())
            if resumed is not None:
                _assert_holds(folder / "last-1.ckpt", saved[step])
            at += 1
    assert cases >= 18, cases  # every write, rename and removal of the save was a point


def test_temp_folders_of_dead_saves_are_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    _save(folder / "last.ckpt", 5)
    for name in (".last.ckpt.tmp-dead1", ".last.ckpt.tmp-dead2"):  # saves killed while writing shards
        shutil.copytree(folder / "last.ckpt", folder / name)
        (folder / name / "meta.pt").unlink()
    weights = _save(folder / "last.ckpt", 10)
    assert _debris(folder) == []
    _assert_holds(folder / "last.ckpt", weights)


def test_a_sharded_save_that_fails_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from yamlformer.builder.checkpoints import CheckpointWriteError

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    weights = _save(folder / "last.ckpt", 5)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointWriteError) as caught:
        _save(folder / "last.ckpt", 10)
    assert str(caught.value) == (
        f"could not write {folder / 'last.ckpt'}: no space left on the device; the previous last.ckpt is kept"
    )
    assert _debris(folder) == []
    _assert_holds(folder / "last.ckpt", weights)


def _flip(file: Path) -> None:
    """One bit flipped: in the middle of a shard's tensor bytes, in ``meta.pt``'s pickle (the
    spec's name; a flip in the zip's alignment padding changes nothing that is read)."""
    data = bytearray(file.read_bytes())
    at = data.find(b"tiny-llama") if file.name == "meta.pt" else len(data) // 2
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)


@pytest.mark.parametrize(
    "name, harm",
    [
        ("__0_0.distcp", _flip),
        ("__0_0.distcp", _truncate),
        (".metadata", _flip),
        ("meta.pt", _flip),
        (".metadata", Path.unlink),
    ],
)
def test_a_damaged_shard_is_a_one_line_error_naming_it_in_every_reader(tmp_path, capsys, name, harm):
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    _save(last, 5)
    harm(last / name)
    commands = [
        ("consolidate", str(last), "-o", str(tmp_path / "model.safetensors")),
        ("export-hf", str(last), "-o", str(tmp_path / "hf")),
        ("eval", str(last)),
        ("generate", str(last), "--prompt", "def "),
    ]
    for command in commands:
        assert _main(*command) == 1, command
        _one_line(capsys, str(last), name)
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "hf").exists()


def test_a_resume_falls_back_from_a_damaged_sharded_checkpoint_to_the_newest_intact_one(tmp_path, capsys):
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.run import resume_path

    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    _save(folder / "last.ckpt", 5)
    _save(folder / "last.ckpt", 10)  # step 5 is now last-1.ckpt
    _flip(folder / "last.ckpt" / "__0_0.distcp")

    with pytest.raises(RecipeError, match=r"--resume: .*last\.ckpt is damaged: __0_0\.distcp does not match"):
        resume_path(run, resume=str(folder / "last.ckpt"), fresh=False)  # named: refused, not replaced
    assert _resume(run) == folder / "last-1.ckpt"
    said = capsys.readouterr().out
    assert "__0_0.distcp does not match its checksum" in said and "last.ckpt.damaged" in said
    assert "resuming from" in said and "last-1.ckpt (step 5)" in said
    assert (folder / "last.ckpt.damaged").is_dir()
    weights = _save(folder / "last.ckpt", 15)  # the run goes on; the damaged one is never a predecessor
    _assert_holds(folder / "last.ckpt", weights)
    _assert_holds(folder / "last-1.ckpt", _model(5)[0].state_dict())
    assert _resume(run) == folder / "last.ckpt"

    for path in (folder / "last.ckpt", folder / "last-1.ckpt"):
        _truncate(path / "__0_0.distcp")
    with pytest.raises(RecipeError, match="no intact checkpoint is left .* --fresh"):
        _resume(run)


def test_a_sharded_checkpoint_of_another_spec_or_tokenizer_is_refused_naming_the_field(tmp_path):
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.run import resume_path

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    chars = {"type": "char", "chars": "abc"}
    _save(run / "checkpoints" / "last.ckpt", 5, tokenizer=chars)
    meta = {"spec": _model(5)[1], "tokenizer": chars}
    assert resume_path(run, None, False, meta) == run / "checkpoints" / "last.ckpt"
    with pytest.raises(RecipeError, match=r"different recipe:\n  model\.spec\.d_model: 32 in the checkpoint, 48 now\n"):
        resume_path(run, None, False, dict(meta, spec=dict(meta["spec"], d_model=48)))
    with pytest.raises(RecipeError, match=r"different recipe:\n  tokenizer: a different vocabulary"):
        resume_path(run, None, False, dict(meta, tokenizer=dict(chars, chars="abcd")))


def test_consolidate_writes_one_safetensors_file_that_loads_into_the_spec(tmp_path, capsys):
    from safetensors import safe_open

    from yamlformer.builder import build_model
    from yamlformer.builder.hf import load_weights
    from yamlformer.builder.spec.schema import spec_model

    last = tmp_path / "last.ckpt"
    weights = _save(last, 7)
    out = tmp_path / "out" / "model.safetensors"
    assert _main("consolidate", str(last), "-o", str(out)) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # one file, no temp left
    import json

    with safe_open(str(out), "pt") as f:
        spec = spec_model().model_validate(json.loads(f.metadata()["spec"]))
        assert f.metadata()["global_step"] == "7"
    model = load_weights(build_model(spec), out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name

    assert _main("consolidate", str(last), "-o", str(tmp_path / "model.bin")) == 1
    _one_line(capsys, "-o", ".safetensors")
    assert _main("consolidate", str(tmp_path / "nothing.ckpt"), "-o", str(out)) == 1
    _one_line(capsys, "nothing.ckpt")
    (tmp_path / "a-file").write_text("")
    assert _main("consolidate", str(last), "-o", str(tmp_path / "a-file" / "m.safetensors")) == 1
    _one_line(capsys, "cannot write", "m.safetensors")


def test_model_init_from_a_sharded_folder_starts_a_run_from_its_weights(tmp_path, capsys, monkeypatch):
    """A sharded folder as ``model.init_from`` (which a torch.load of it never read): its spec,
    tokenizer and weights (resharded into one process, every shard file verified) start the run,
    from one read of ``meta.pt`` and of the shards."""
    import string

    from recipe_helpers import tiny_recipe
    from test_checkpoints import reads_until_training

    from yamlformer.builder import build_model
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.trained import pretrained_tokenizer
    from yamlformer.recipes.training.pretrained import load_init_from
    from yamlformer.recipes.training.resolved import resolve_run
    from yamlformer.recipes.training.run import run

    chars = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))  # 96: the vocabulary of SPEC's model
    folder = tmp_path / "pretrained" / "last.ckpt"
    folder.parent.mkdir()
    weights = _save(folder, 9, tokenizer={"type": "char", "chars": chars}, task="lm")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    path = tiny_recipe(
        tmp_path,
        model={"spec": None, "init_from": str(folder)},
        data={"sources": [str(corpus)], "max_bytes": None},
        trainer={"max_steps": 2, "val_check_interval": 100, "limit_val_batches": 1},
    )
    reads = reads_until_training(monkeypatch)
    assert run(path, samples=False)["steps"] == 2
    assert f"weights: {len(weights)} tensors from the run checkpoint {folder}" in capsys.readouterr().out
    meta = str((folder / "meta.pt").resolve())
    shards = str(folder.resolve())
    assert reads[("load", meta)] == reads[("verify", meta)] == 1, dict(reads)
    assert reads[("shards", shards)] == reads[("dcp", shards)] == 1, dict(reads)

    resolved = resolve_run(load_recipe(path))  # what the run started from: the folder's own weights
    assert resolved.spec.vocab_size == pretrained_tokenizer(resolved).vocab_size
    model = build_model(resolved.spec)
    load_init_from(model, resolved)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


# -- slow: multi-process runs (CPU, gloo) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """One process, 20 steps at the global batch of every sharded run below, with ``tokenizer``
    (the char one when None; :data:`sharded_helpers.EVEN_VOCAB` for one compared with tensor
    parallelism): ``(losses, last.ckpt)``, trained once per tokenizer."""
    runs: dict[str, tuple] = {}

    def run(tokenizer: dict | None = None) -> tuple:
        key = json.dumps(tokenizer, sort_keys=True)
        if key not in runs:
            folder = tmp_path_factory.mktemp("unbroken")
            train(recipe(folder, batch=4, spec=SPEC, tokenizer=tokenizer))
            runs[key] = losses(folder / "run"), folder / "run" / "checkpoints" / "last.ckpt"
        return runs[key]

    return run


def _upto(history: dict, step: int) -> dict:
    """The training losses of a run stopped after ``step`` optimizer steps (an entry is keyed by
    the optimizer steps done when its interval was read: the last one of a run to 12 is 12)."""
    return {"train": [(s, x) for s, x in history["train"] if s <= step]}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_save_leaves_the_last_checkpoint_whole_and_the_same_command_resumes(
    tmp_path, unbroken, victim
):
    from yamlformer.builder.checkpoints import load_model, read_meta

    path = recipe(tmp_path, batch=2, devices=2, strategy="fsdp", spec=SPEC, checkpoint_every_n_steps=1)
    folder = tmp_path / "run" / "checkpoints"
    with open(tmp_path / "killed.log", "wb") as log:  # the child writes it until killed
        child, ranks, signals = train_paused_in_save(path, at=4, ranks=2, log=log)  # the save of step 4
        try:
            assert (folder / "last-1.ckpt").is_dir() and list(folder.glob(".last.ckpt.tmp-*"))
            os.kill(ranks[victim], signal.SIGKILL)  # while the ranks write a save, after a few steps
            (signals / "go").touch()
            # the other rank notices its peer is gone: it stops with an error, it does not hang
            deadline = time.monotonic() + 120
            while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_alive(pid) for pid in ranks), "a rank still runs after its peer was killed"
        finally:
            for pid in ranks:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            child.wait()
    assert child.returncode != 0

    step = read_meta(folder / "last.ckpt")["global_step"]  # verified: every shard matches its checksum
    assert step == 3  # the last save that finished
    load_model(folder / "last.ckpt")
    out = train(path)  # the same command: it resumes, saves over the debris and finishes the run
    assert "resuming from" in out
    assert read_meta(folder / "last.ckpt")["global_step"] == 20
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert_same_losses(losses(tmp_path / "run"), unbroken()[0], keys=("train",))


FSDP = {"strategy": "fsdp"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, then",
    [
        ({**FSDP, "devices": 4, "batch": 1}, {**FSDP, "devices": 2, "batch": 2}),
        ({**FSDP, "devices": 4, "batch": 2, "tensor_parallel": 2}, {**FSDP, "devices": 2, "batch": 2}),
        ({**FSDP, "devices": 2, "batch": 2}, {**FSDP, "devices": 2, "batch": 4, "tensor_parallel": 2}),
        ({**FSDP, "devices": 2, "batch": 2}, {"devices": 1, "batch": 4}),  # a sharded run goes on in one process
        ({"devices": 1, "batch": 4}, {**FSDP, "devices": 2, "batch": 2}),  # and a one-process run sharded
    ],
    ids=["fsdp4-fsdp2", "tp2xfsdp2-fsdp2", "fsdp2-tp2", "fsdp2-one", "one-fsdp2"],
)
def test_a_resume_on_another_layout_reshards_and_continues_like_an_unbroken_run(tmp_path, unbroken, first, then):
    from transformers import AutoModelForCausalLM

    from yamlformer.builder import build_model
    from yamlformer.builder.checkpoints import load_model
    from yamlformer.builder.hf import load_weights

    # the char vocabulary (95) does not split in two: a run with tensor parallelism on either side
    # uses an even one, and so does the unbroken run it is compared with
    tokenizer = EVEN_VOCAB if "tensor_parallel" in {**first, **then} else None
    train(recipe(tmp_path, spec=SPEC, steps=10, tokenizer=tokenizer, **first))
    out = train(recipe(tmp_path, spec=SPEC, tokenizer=tokenizer, **then))  # the same run folder, resumed
    assert "resuming from" in out
    losses_unbroken, last_unbroken = unbroken(tokenizer)
    assert_same_losses(losses(tmp_path / "run"), losses_unbroken, keys=("train",))

    # the sharded checkpoint read whole, exported to HF and consolidated: the unsharded model's logits
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    model, meta = load_model(last)
    reference, _ = load_model(last_unbroken)
    assert _main("export-hf", str(last), "-o", str(tmp_path / "hf")) == 0
    assert _main("consolidate", str(last), "-o", str(tmp_path / "model.safetensors")) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    consolidated = load_weights(build_model(model.spec), tmp_path / "model.safetensors").eval()
    ids = torch.randint(0, model.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        torch.testing.assert_close(hf(ids).logits, logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(consolidated(ids), logits, rtol=0, atol=0)
        torch.testing.assert_close(logits, reference(ids), rtol=0, atol=1e-4)  # trained alike, to fp32 order


@pytest.mark.slow
def test_a_damaged_shard_of_a_run_is_named_and_the_same_command_resumes_from_the_intact_one(tmp_path, unbroken, capsys):
    from yamlformer.builder.checkpoints import read_meta

    path = recipe(tmp_path, batch=2, devices=2, strategy="fsdp", spec=SPEC, steps=12, checkpoint_every_n_steps=4)
    train(path)
    folder = tmp_path / "run" / "checkpoints"
    step = read_meta(folder / "last-1.ckpt")["global_step"]
    assert step < 12
    _flip(folder / "last.ckpt" / "__1_0.distcp")  # rank 1's shard of step 12
    _truncate(folder / "best.ckpt" / "__0_0.distcp")  # best.ckpt may be of step 12 too
    last = str(folder / "last.ckpt")
    for command in (
        ("eval", last),
        ("export-hf", last, "-o", str(tmp_path / "hf")),
        ("consolidate", last, "-o", str(tmp_path / "m.safetensors")),
    ):
        assert _main(*command) == 1
        _one_line(capsys, "last.ckpt is damaged: __1_0.distcp does not match its checksum")
    out = train(path)  # the same command
    assert "__1_0.distcp does not match its checksum" in out and "kept as last.ckpt.damaged" in out
    assert f"resuming from {folder / 'last-1.ckpt'} (step {step})" in out
    assert read_meta(folder / "last.ckpt")["global_step"] == 12
    assert_same_losses(losses(tmp_path / "run"), _upto(unbroken()[0], 12), keys=("train",))
