"""Pipeline x tensor x FSDP2 parallelism on 8 CPU processes (gloo): PP 2 x TP 2 x FSDP 2 trains
like one process at the same global batch for 20 steps, its checkpoint resumes in one process as
an unbroken run, and every rank holds exactly the parameters ``yamlformer.builder.analysis.layout.rank_states``
counts for the stage it holds. Slow (8 processes start torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharded_helpers import EVEN_VOCAB, assert_same_losses, end_process_group, losses, recipe, train
from test_pipeline_parallel import TINY_PP

pytestmark = pytest.mark.slow

WORLD, TP, PP = 8, 2, 2
#: the 3-D layout's trainer settings; ``batch=2`` per data-parallel rank: 8 / (PP 2 x TP 2) = 2 of
#: them, so 4 sequences a step, as the one-process run's
LAYOUT_3D = {"strategy": "fsdp", "tensor_parallel": TP, "pipeline_parallel": PP, "microbatches": 2}
SEED = 7


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.parallel import layout_of, parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh
    from yamlformer.recipes.parallel.pipeline import build_pipeline
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    settings = TrainerSection(accelerator="cpu", devices=WORLD, **LAYOUT_3D)
    mesh = device_mesh(layout_of(settings), "cpu")
    cpu = torch.device("cpu")
    model = build_model(spec_model().model_validate(dict(TINY_PP, vocab_size=400)), device="meta")

    def stage(view):
        return parallelize(view, settings, mesh, init_seed=SEED, device=cpu)

    part, _ = build_pipeline(model, settings, mesh, cpu, lambda logits, targets: logits.sum(), stage)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in part.parameters()]
    held = {"elements": sum(t.numel() for t in local), "weights": sum(t.numel() * t.element_size() for t in local)}
    held["tensors"], held["names"] = len(local), [name for name, _ in part.named_parameters()]
    Path(out, f"{rank}.json").write_text(json.dumps(held))
    end_process_group()


def test_every_rank_of_pp2_tp2_fsdp2_holds_what_the_layout_counts_for_its_stage(tmp_path):
    from yamlformer.builder.analysis.layout import Layout, rank_states
    from yamlformer.builder.analysis.shards import stage_tensors
    from yamlformer.builder.spec.schema import spec_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    spec = spec_model().model_validate(dict(TINY_PP, vocab_size=400))
    layout = Layout(devices=WORLD, tensor_parallel=TP, pipeline_parallel=PP)
    for rank in range(WORLD):
        held = json.loads((tmp_path / f"{rank}.json").read_text())
        stage = layout.mesh(rank)["pp"]
        tensors = stage_tensors(spec, [stage], PP)
        assert sorted(held.pop("names")) == sorted(t.name for t in tensors), rank
        want = rank_states(spec, layout, rank, tensors)
        assert held == {"elements": want.elements, "weights": want.weights, "tensors": want.tensors}, rank


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run both layouts below are compared with (20 steps, batch 4)."""
    folder = tmp_path_factory.mktemp("one")
    train(recipe(folder, batch=4, spec=TINY_PP, tokenizer=EVEN_VOCAB))
    return losses(folder / "run")


def test_pp2_tp2_fsdp2_on_eight_processes_trains_like_one(tmp_path, one_process):
    out = train(recipe(tmp_path / "3d", batch=2, devices=WORLD, spec=TINY_PP, tokenizer=EVEN_VOCAB, **LAYOUT_3D))
    assert f"MEMBER: {WORLD}/{WORLD}" in out
    assert_same_losses(losses(tmp_path / "3d" / "run"), one_process, keys=("train",))


def test_a_pp2_tp2_fsdp2_checkpoint_resumes_in_one_process_like_an_unbroken_run(tmp_path, one_process):
    """PP 2 x TP 2 x FSDP 2 for 10 steps, then one process to 20: the sharded folder (each stage's
    tensor- and FSDP-sharded parameters and their optimizer state) read whole, by the whole model's
    names, and the losses of all 20 steps those of one process throughout."""
    moved = tmp_path / "moved"
    train(recipe(moved, batch=2, devices=WORLD, spec=TINY_PP, tokenizer=EVEN_VOCAB, steps=10, **LAYOUT_3D))
    out = train(recipe(moved, batch=4, spec=TINY_PP, tokenizer=EVEN_VOCAB))
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), one_process, keys=("train",))
