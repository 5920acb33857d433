"""A head tied to its embedding across pipeline stages, and a vocabulary padded as Megatron-LM pads
it (the spec's ``pad_vocab_to_multiple_of``), on CPU processes (gloo).

The cheap checks run in the default suite: a padded model computes what the unpadded one does
(the padded ids' logits cut off, their rows never trained), its Hugging Face export is unpadded
and reads back into a padded model; two pipeline ranks of a tied model start with the same table
(named as the whole model names it on both), and after one step each holds the gradient one
process computes (the embedding's and the head's summed). The slow one trains a tied spec with an
odd vocabulary under TP 2 x PP 2 on 4 processes like one process, and resumes its checkpoint in
one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from sharded_helpers import assert_same_losses, end_process_group, losses, recipe, train
from test_pipeline_parallel import TINY_PP

#: the tiny pipeline spec, tied; the char tokenizer of the tiny corpus gives it 95 ids (odd), padded to
#: Megatron-LM's 128 x TP 2
TIED = {**TINY_PP, "name": "tiny-tied", "tie_embeddings": True, "pad_vocab_to_multiple_of": 256}
VOCAB, SEED = 95, 11


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def test_a_padded_vocabulary_computes_what_the_unpadded_one_does_and_exports_unpadded(tmp_path):
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf.reader import from_hf
    from yamlformer.builder.hf.weights import load_weights
    from yamlformer.builder.hf.writer import to_hf

    plain = build_model({**TIED, "vocab_size": VOCAB, "pad_vocab_to_multiple_of": 1}, init_seed=SEED)
    padded = build_model({**TIED, "vocab_size": VOCAB}, init_seed=SEED)
    assert padded.spec.padded_vocab_size == 256 and padded.decoder.embedding.tokens.weight.shape == (256, 32)
    ids, targets = _batch()
    out, want = padded(ids), plain(ids)
    assert out.shape == (4, 16, VOCAB)  # the padded ids' logits never leave the head
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    _loss(out, targets).backward()
    _loss(want, targets).backward()
    grad = padded.decoder.embedding.tokens.weight.grad
    torch.testing.assert_close(grad[:VOCAB], plain.decoder.embedding.tokens.weight.grad, rtol=0, atol=0)
    assert not grad[VOCAB:].any()  # the padded rows learn nothing
    to_hf(padded.spec, padded, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and "pad_vocab_to_multiple_of" not in config
    spec, state = from_hf(tmp_path / "hf")
    assert spec.vocab_size == VOCAB and tuple(state["decoder.embedding.tokens.weight"].shape) == (VOCAB, 32)
    again = load_weights(build_model({**TIED, "vocab_size": VOCAB}, init_seed=SEED + 1), state)
    torch.testing.assert_close(again(ids), want, rtol=0, atol=0)


def _tie_worker(rank: int, store: str, out: str) -> None:
    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.parallel import layout_of, parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh
    from yamlformer.recipes.parallel.pipeline import build_pipeline
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    settings = TrainerSection(accelerator="cpu", devices=2, strategy="fsdp", pipeline_parallel=2, microbatches=2)
    mesh = device_mesh(layout_of(settings), "cpu")
    cpu = torch.device("cpu")
    model = build_model({**TIED, "vocab_size": VOCAB}, device="meta")

    def stage(view):
        return parallelize(view, settings, mesh, init_seed=SEED, device=cpu)

    part, pipeline = build_pipeline(model, settings, mesh, cpu, _loss, stage)
    (table,) = pipeline.tied()
    start = table.full_tensor().clone()
    loss = pipeline.train_step(*_batch())
    names = [name for name, _ in part.named_parameters()]
    torch.save(
        {
            "names": names,
            "start": start,
            "grad": table.grad.full_tensor(),
            "loss": float(loss),
            "duplicates": len(pipeline.duplicates),
        },
        Path(out, f"{rank}.pt"),
    )
    end_process_group()


def test_two_pipeline_ranks_of_a_tied_model_sum_the_table_s_gradients_as_one_process_has_them(tmp_path):
    from yamlformer.builder.assemble import build_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tie_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    one = build_model({**TIED, "vocab_size": VOCAB}, init_seed=SEED)
    ids, targets = _batch()
    loss = _loss(one(ids), targets)
    loss.backward()
    table = one.decoder.embedding.tokens.weight
    first, last = (torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1))
    name = "decoder.embedding.tokens.weight"
    assert name in first["names"] and name in last["names"] and "head.proj.weight" not in last["names"]
    for held in (first, last):  # the same start (seeded by the one name), the summed gradient
        torch.testing.assert_close(held["start"], table.detach(), rtol=0, atol=0)
        torch.testing.assert_close(held["grad"], table.grad, rtol=1e-5, atol=1e-7)
        assert held["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert (first["duplicates"], last["duplicates"]) == (0, 1)  # the norm counts the table once


@pytest.mark.slow
def test_a_tied_spec_with_an_odd_vocabulary_trains_under_tp2_pp2_like_one_process(tmp_path):
    """TP 2 x PP 2 on 4 processes: the 95-id vocabulary padded to 256 rows split over the TP ranks,
    the tied table on the first and last stages' ranks; 20 steps with the losses of one process,
    and 10 steps resumed in one process to 20 likewise (the checkpoint names the table once)."""
    layout = {"strategy": "fsdp", "tensor_parallel": 2, "pipeline_parallel": 2, "microbatches": 2}
    train(recipe(tmp_path / "one", batch=4, spec=TIED))
    one = losses(tmp_path / "one" / "run")
    train(recipe(tmp_path / "split", batch=4, devices=4, spec=TIED, **layout))
    assert_same_losses(losses(tmp_path / "split" / "run"), one, keys=("train",))
    moved = tmp_path / "moved"
    train(recipe(moved, batch=4, devices=4, spec=TIED, steps=10, **layout))
    assert "resuming from" in train(recipe(moved, batch=4, spec=TIED))
    assert_same_losses(losses(moved / "run"), one, keys=("train",))
