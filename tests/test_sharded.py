"""Sharded training on CPU processes (gloo): FSDP2 and tensor parallelism train like one process,
sharded checkpoints save atomically, resume across layouts and read whole; bad layouts are refused
in one line before any work. The multi-process runs beyond the first are ``slow``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from recipe_helpers import tiny_recipe
from sharded_helpers import EVEN_VOCAB, assert_same_losses, losses, recipe, train, train_paused_in_save

torch.set_num_threads(1)

TINY_MOE = {
    "name": "tiny-moe",
    "architecture": "decoder-only",
    "d_model": 32,
    "max_seq_len": 32,
    "position": {"type": "rope"},
    "decoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4, "n_kv_heads": 2},
        "ffn": {"type": "moe", "n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 32}},
        "norm": {"type": "rmsnorm"},
    },
}
#: GQA, query/key/value biases, a GLU and an untied head (Qwen2's layout, so it exports to HF)
TINY_TP = {
    "name": "tiny-tp",
    "architecture": "decoder-only",
    "d_model": 32,
    "max_seq_len": 32,
    "position": {"type": "rope"},
    "decoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True},
        "ffn": {"type": "glu", "hidden_dim": 64},
        "norm": {"type": "rmsnorm"},
    },
}


def _main(*args: str) -> int:
    from yamlformer.builder.cli import main

    return main(list(args))


def _one_line_error(capsys, *needles: str) -> str:
    """The one line a refusal prints (progress bars left out)."""
    lines = [
        line
        for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("tokenizing")
    ]
    err = "\n".join(lines)
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# -- the default suite: one 2-process run, and the refusals -----------------------------------------


def test_fsdp_on_two_processes_trains_like_one_and_its_sharded_checkpoint_reads_whole(tmp_path, capsys):
    from safetensors.torch import load_file

    from yamlformer.builder.checkpoints import is_sharded, load_model
    from yamlformer.recipes.training.run import run

    sharded = recipe(tmp_path / "fsdp", batch=2, devices=2, strategy="fsdp")
    out = train(sharded)
    assert "MEMBER: 2/2" in out
    run(recipe(tmp_path / "one", batch=4), samples=False)
    assert_same_losses(losses(tmp_path / "fsdp" / "run"), losses(tmp_path / "one" / "run"))

    last = tmp_path / "fsdp" / "run" / "checkpoints" / "last.ckpt"
    assert is_sharded(last) and len(list(last.glob("*.distcp"))) == 2  # each rank wrote its own shards
    assert not list(last.parent.glob(".*"))  # no temp or old folders left behind
    model, meta = load_model(last)
    reference, _ = load_model(tmp_path / "one" / "run" / "checkpoints" / "last.ckpt")
    assert meta["global_step"] == 20
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)

    capsys.readouterr()
    assert _main("consolidate", str(last), "-o", str(tmp_path / "model.safetensors")) == 0
    capsys.readouterr()
    weights = load_file(tmp_path / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in weights:  # the tied head is written once, under the embedding's name
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
    assert _main("eval", str(last), "--max-batches", "1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 20
    assert _main("generate", str(last), "--prompt", "def ", "--max-new-tokens", "4", "--seed", "0") == 0

    # the same command with another spec or tokenizer is refused before anything runs, naming the field
    assert _main("train", str(sharded), "--no-samples", "--set", "model.overrides.d_model=48") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "different recipe" in err and "model.spec.d_model: 32 in the checkpoint" in err
    assert (
        _main(
            "train",
            str(sharded),
            "--no-samples",
            "--set",
            "tokenizer.type=sentencepiece",
            "--set",
            "tokenizer.vocab_size=400",
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and "different recipe" in err and "tokenizer" in err


def test_a_tensor_parallel_degree_that_does_not_divide_the_heads_is_refused_at_its_line(tmp_path, capsys):
    """Every problem of the layout at once, each at its line: the heads at the recipe's, and the
    vocabulary (the tokenizer's 95 symbols: the spec is resolved with the real vocabulary) at the
    tokenizer, not at a ``--set`` nobody typed."""
    path = tiny_recipe(tmp_path, trainer={"strategy": "fsdp", "devices": 4, "tensor_parallel": 4})
    assert _main("train", str(path)) == 1
    err = capsys.readouterr().err
    lines = [
        line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("tokenizing")
    ]
    assert "Traceback" not in err and "--set" not in err and len(lines) == 2, err
    heads = next(line for line in lines if "n_heads" in line)
    assert (
        "recipe.yaml:" in heads
        and "model.spec.decoder.attention.n_heads" in heads
        and "tensor-parallel degree 4" in heads
    )
    vocab = next(line for line in lines if "vocab_size" in line)
    assert vocab.startswith("<the tokenizer's vocabulary>: model.spec.vocab_size: 95 rows"), vocab
    assert not list((tmp_path / "cache").rglob("*.bin"))  # before tokenizing the corpus


def test_a_vocabulary_that_does_not_split_is_refused(tmp_path, capsys):
    # the char vocabulary of this corpus has 95 symbols (94 characters and eos): 4 does not divide it
    spec = dict(TINY_MOE, decoder=dict(TINY_MOE["decoder"], attention={"n_heads": 4}))
    path = tiny_recipe(tmp_path, model={"spec": spec}, trainer={"strategy": "fsdp", "devices": 4, "tensor_parallel": 4})
    assert _main("train", str(path)) == 1
    _one_line_error(capsys, "vocab_size", "95 rows", "split over 4 tensor-parallel", "pad_vocab_to_multiple_of")


def test_hybrid_on_one_node_and_devices_that_do_not_exist_are_refused(tmp_path, capsys):
    path = tiny_recipe(tmp_path, trainer={"strategy": "fsdp", "devices": 2, "data_parallel": "hybrid"})
    assert _main("train", str(path)) == 1
    _one_line_error(capsys, "recipe.yaml:", "trainer.data_parallel", "num_nodes")
    path = tiny_recipe(tmp_path, trainer={"strategy": "fsdp", "devices": 8, "accelerator": "cuda"})
    assert _main("train", str(path)) == 1
    want = "CUDA device" if not torch.cuda.is_available() else "trainer.devices 8"
    _one_line_error(capsys, want)
    path = tiny_recipe(tmp_path, trainer={"strategy": "fsdp", "devices": 3, "tensor_parallel": 2})
    assert _main("train", str(path)) == 1
    _one_line_error(capsys, "trainer.tensor_parallel", "divide")
    path = tiny_recipe(tmp_path, trainer={"accelerator": "cpu", "devices": 9999})  # a process per device
    assert _main("train", str(path)) == 1
    _one_line_error(capsys, "trainer.devices 9999", "at most")
    assert not list((tmp_path / "cache").rglob("*.bin"))


def test_fill_draws_any_slice_of_a_parameter_exactly():
    from yamlformer.blocks.init import fill, row_block

    shapes = [(7, 5), (300, 700), (1, 4), (131073,), (5, 3, 2)]
    for shape in shapes:
        whole = torch.empty(shape)
        fill(whole, ("normal", 0.02), 11, "w", shape)
        assert abs(whole.std().item() - 0.02) < 0.02 * (0.5 if whole.numel() > 100 else 1.5)
        rows = shape[0]
        for first, last in ((0, rows), (rows // 3, rows // 3 + max(1, rows // 4)), (rows - 1, rows)):
            cols = (1, min(3, shape[1])) if len(shape) > 1 and shape[1] > 1 else None
            part_shape = (last - first, *shape[1:])
            offset = (first, *([0] * (len(shape) - 1)))
            if cols is not None:  # a column slice too (a row-wise tensor-parallel shard)
                part_shape = (last - first, cols[1] - cols[0], *shape[2:])
                offset = (first, cols[0], *([0] * (len(shape) - 2)))
            part = torch.empty(part_shape)
            fill(part, ("normal", 0.02), 11, "w", shape, offset)
            index = tuple(slice(o, o + n) for o, n in zip(offset, part_shape))
            assert torch.equal(part, whole[index]), (shape, offset)
        assert row_block(shape) >= 1


# -- slow: the layouts, the faults, the reshards -------------------------------------------------------


def _translation(folder: Path, **trainer) -> Path:
    """A tiny encoder-decoder translation recipe on synthetic pairs (word-by-word substitution)."""
    import random

    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    source = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(300)]
    for name, lines in (("train", source[:260]), ("val", source[260:])):
        (folder / f"{name}.src").write_text("\n".join(lines) + "\n")
        (folder / f"{name}.tgt").write_text("\n".join(s.replace("w", "v") for s in lines) + "\n")
    files = {split: {"source": f"{split}.src", "target": f"{split}.tgt"} for split in ("train", "val")}
    stack = {
        "n_layers": 2,
        "attention": {"n_heads": 4},
        "ffn": {"type": "mlp", "activation": "relu", "hidden_dim": 64},
        "norm": {"type": "layernorm"},
    }
    spec = {
        "name": "tiny-translation",
        "architecture": "encoder-decoder",
        "d_model": 32,
        "max_seq_len": 64,
        "tie_embeddings": True,
        "share_encoder_decoder_embeddings": True,
        "position": {"type": "sinusoidal"},
        "encoder": stack,
        "decoder": stack,
    }
    doc = {
        "task": "translation",
        "model": {"spec": spec},
        "data": {
            "train": files["train"],
            "validation": files["val"],
            "max_tokens": 160,
            "cache_dir": str(folder.parent / "cache"),
        },
        "tokenizer": {"vocab_size": 274},
        "schedule": {"type": "constant", "warmup_steps": 2},
        "trainer": {
            "max_steps": 20,
            "val_check_interval": 10,
            "limit_val_batches": 1,
            "checkpoint_every_n_steps": 10,
            "accelerator": "cpu",
            "precision": "32",  # forced: `auto` is bf16 on a CPU with AVX512-BF16, beyond fp32 reduction tolerance
            "output_dir": str(folder / "run"),
            **trainer,
        },
        "eval": {"bleu_at_validation": False, "average_last": 1, "average_every_n_steps": 10, "num_beams": 1},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.slow
def test_fsdp_encoder_decoder_on_two_processes_trains_like_one_accumulating_two(tmp_path):
    # the token-budget batches go to ranks in turn, so one process accumulating two micro-batches
    # sees what two processes see in one step
    train(_translation(tmp_path / "fsdp", devices=2, strategy="fsdp"))
    train(_translation(tmp_path / "one", devices=1, accumulate_grad_batches=2))
    # validation: each rank's mean over its share of the batches, so compared on training only
    assert_same_losses(losses(tmp_path / "fsdp" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
def test_fsdp_moe_on_two_processes_trains_like_one_accumulating_two(tmp_path):
    # the balancing loss is a statistic of each micro-batch, so the reference accumulates the same two
    train(recipe(tmp_path / "fsdp", batch=2, devices=2, strategy="fsdp", spec=TINY_MOE))
    train(recipe(tmp_path / "one", batch=2, spec=TINY_MOE, accumulate_grad_batches=2))
    assert_same_losses(losses(tmp_path / "fsdp" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
def test_tensor_parallel_and_tp_x_fsdp_train_like_one_process_and_export_to_hf(tmp_path):
    # clipped (a norm over every mesh dimension), so clipping across the mesh is checked against one process
    train(recipe(tmp_path / "one", batch=4, spec=TINY_TP, tokenizer=EVEN_VOCAB, gradient_clip_val=1.0))
    reference = losses(tmp_path / "one" / "run")
    train(
        recipe(
            tmp_path / "tp",
            batch=4,
            devices=2,
            strategy="fsdp",
            tensor_parallel=2,
            spec=TINY_TP,
            tokenizer=EVEN_VOCAB,
            gradient_clip_val=1.0,
        )
    )
    assert_same_losses(losses(tmp_path / "tp" / "run"), reference)
    out = train(
        recipe(
            tmp_path / "tp-fsdp",
            batch=2,
            devices=4,
            strategy="fsdp",
            tensor_parallel=2,
            spec=TINY_TP,
            tokenizer=EVEN_VOCAB,
            precision="32",
            gradient_clip_val=1.0,
        )
    )
    assert_same_losses(losses(tmp_path / "tp-fsdp" / "run"), reference)
    # the clipped gradient norm over (dp_shard, tp) is one all-reduce on the flattened mesh, not two in turn
    assert "sequential all_reduce" not in out

    from transformers import AutoModelForCausalLM

    from yamlformer.builder.checkpoints import load_model

    last = tmp_path / "tp-fsdp" / "run" / "checkpoints" / "last.ckpt"
    assert _main("export-hf", str(last), "-o", str(tmp_path / "hf")) == 0
    model, _ = load_model(last)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, model.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_encoder_decoder_trains_like_one_process(tmp_path):
    # self- and cross-attention split; a tensor-parallel group is one data-parallel rank, so it
    # reads what one process reads (validation included)
    train(_translation(tmp_path / "one", devices=1))
    train(_translation(tmp_path / "tp", devices=2, strategy="fsdp", tensor_parallel=2))
    assert_same_losses(losses(tmp_path / "tp" / "run"), losses(tmp_path / "one" / "run"))


@pytest.mark.slow
def test_tensor_parallel_moe_trains_like_one_process(tmp_path):
    # attention split; the router and the experts replicated (their gradients agree across the group)
    train(recipe(tmp_path / "one", batch=4, spec=TINY_MOE, tokenizer=EVEN_VOCAB))
    train(
        recipe(
            tmp_path / "tp", batch=4, devices=2, strategy="fsdp", tensor_parallel=2, spec=TINY_MOE, tokenizer=EVEN_VOCAB
        )
    )
    assert_same_losses(losses(tmp_path / "tp" / "run"), losses(tmp_path / "one" / "run"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder-decoder", "moe"])
def test_tp_x_fsdp_on_four_processes_trains_like_one_accumulating_two(kind, tmp_path):
    # two data-parallel ranks of a tensor-parallel pair each: one process accumulating the same two
    # micro-batches is the reference (token-budget batches go to ranks in turn; the balancing loss
    # is a statistic of each micro-batch)
    if kind == "moe":
        make = lambda folder, **trainer: recipe(folder, batch=2, spec=TINY_MOE, tokenizer=EVEN_VOCAB, **trainer)
    else:
        make = _translation
    train(make(tmp_path / "tp-fsdp", devices=4, strategy="fsdp", tensor_parallel=2))
    train(make(tmp_path / "one", devices=1, accumulate_grad_batches=2))
    assert_same_losses(losses(tmp_path / "tp-fsdp" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
def test_resume_on_another_layout_continues_like_an_unbroken_run(tmp_path):
    train(recipe(tmp_path / "one", batch=4))
    moved = tmp_path / "moved"
    train(recipe(moved, batch=1, devices=4, strategy="fsdp", steps=10))
    out = train(recipe(moved, batch=2, devices=2, strategy="fsdp"))  # the same command, 4 -> 2 processes
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), losses(tmp_path / "one" / "run"))


@pytest.mark.slow
def test_a_rank_killed_during_a_sharded_save_leaves_the_last_checkpoint_whole(tmp_path):
    from yamlformer.builder.checkpoints import load_model, read_meta

    path = recipe(
        tmp_path, batch=2, devices=2, strategy="fsdp", steps=400, checkpoint_every_n_steps=1, val_check_interval=1000
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with open(tmp_path / "killed.log", "wb") as log:
        child, ranks, signals = train_paused_in_save(path, at=3, ranks=2, log=log)
        try:
            assert list(last.parent.glob(".last.ckpt.tmp-*")) and read_meta(last)["global_step"] == 2
            os.kill(ranks[1], signal.SIGKILL)  # rank 1, while the ranks write the save of step 3
            (signals / "go").touch()
            child.wait(timeout=120)  # rank 0 notices its peer is gone: an error, not a hang
        finally:
            child.kill()
            child.wait()
    assert child.returncode != 0
    step = read_meta(last)["global_step"]
    assert step == 2
    load_model(last)  # whole and loadable

    out = train(path, "--set", f"trainer.max_steps={step + 3}")  # the same command resumes; saves go on
    assert "resuming from" in out and read_meta(last)["global_step"] == step + 3
    assert not list(last.parent.glob(".last.ckpt.*"))


def test_a_single_node_run_listens_below_the_ephemeral_range(monkeypatch):
    """Lightning's port came from the kernel's ephemeral range, where any outgoing connection
    could take it before rank 0's store bound it (EADDRINUSE at start, seen in CI)."""
    from yamlformer.recipes.parallel.rendezvous import LOWEST, bindable, choose_main_port, ephemeral_range

    monkeypatch.delenv("MASTER_PORT", raising=False)
    choose_main_port(num_nodes=1, processes=1)
    assert "MASTER_PORT" not in os.environ  # one process has no store
    choose_main_port(num_nodes=2, processes=4)
    assert "MASTER_PORT" not in os.environ  # a multi-node launcher sets it
    choose_main_port(num_nodes=1, processes=2)
    port = int(os.environ["MASTER_PORT"])
    assert LOWEST <= port < ephemeral_range()[0] and bindable(port)
    monkeypatch.setenv("MASTER_PORT", "29511")
    choose_main_port(num_nodes=1, processes=2)
    assert os.environ["MASTER_PORT"] == "29511"  # the user's stays
