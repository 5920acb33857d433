"""Muon under FSDP2 and tensor parallelism (``yamlformer.recipes.optim.muon``: each hidden matrix's update
gathered whole, orthogonalised on every rank, each keeping its shard) steps as one process does:
20 steps of a muP spec at twice its base width (its init factors, drawn shard by shard on the
meta-device start, its output multiplier and, with Moonshot's shape factor, its learning-rate
multipliers, all not 1, must survive sharding), on 2 CPU processes (gloo), FSDP2 over 2 ranks and
tensor parallelism over 2, equal to one process within fp32 rounding; halfway the sharded state
goes through the state dicts a sharded checkpoint holds into a model started elsewhere. Slow."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from recipe_helpers import TINY_SPEC
from sharded_helpers import end_process_group

from yamlformer.builder.spec.schema import spec_model

pytestmark = pytest.mark.slow

#: the tiny decoder at twice its base width, its vocabulary even (a vocab-parallel table splits it)
SPEC = {**copy.deepcopy(TINY_SPEC), "vocab_size": 64, "parametrization": {"type": "mup", "base_d_model": 16}}
SEED, STEPS, BATCH = 3, 20, 4


def _muon():
    from yamlformer.builder.optim.configs import MuonConfig

    # Newton-Schulz in fp32: the comparison is of the sharding, not of bf16 rounding; match_rms_adamw:
    # a hidden matrix's muP multiplier is 1 / sqrt(2) at twice the base width
    return MuonConfig(lr=3e-3, adamw_lr=3e-3, adjust_lr="match_rms_adamw", ns_precision="fp32")


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(step))


def _train(model, optimizer, rows: slice, steps: range = range(STEPS)) -> None:
    for step in steps:
        ids = _batch(step)[rows]
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, tp: int, store: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.optim import build_optimizer
    from yamlformer.recipes.parallel import layout_of, parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    settings = TrainerSection(strategy="fsdp", accelerator="cpu", devices=world, tensor_parallel=tp, precision="32")
    mesh = device_mesh(layout_of(settings), "cpu")
    spec = spec_model().model_validate(SPEC)
    share = BATCH // (world // tp)
    rows = slice((rank // tp) * share, (rank // tp + 1) * share)
    model = parallelize(build_model(spec, device="meta"), settings, mesh, init_seed=SEED, device=torch.device("cpu"))
    optimizer = build_optimizer(_muon(), model, spec)
    _train(model, optimizer, rows, range(STEPS // 2))
    # the sharded state as a checkpoint holds it (torch.distributed.checkpoint's state dicts, by name),
    # into a model started from other weights: the second half resumes the first
    saved = get_state_dict(model, optimizer)
    model = parallelize(
        build_model(spec, device="meta"), settings, mesh, init_seed=SEED + 1, device=torch.device("cpu")
    )
    optimizer = build_optimizer(_muon(), model, spec)
    set_state_dict(model, optimizer, model_state_dict=saved[0], optim_state_dict=saved[1])
    _train(model, optimizer, rows, range(STEPS // 2, STEPS))
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(whole, Path(out) / "sharded.pt")
    end_process_group()


@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "tensor-parallel"])
def test_sharded_muon_steps_as_one_process(tp, tmp_path):
    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.optim import build_optimizer

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, tp, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    spec = spec_model().model_validate(SPEC)
    model = build_model(spec, init_seed=SEED)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(_muon(), model, spec)
    rates = [g["lr"] for g in optimizer.param_groups if g["muon"]]
    assert rates and all(rate == pytest.approx(3e-3 * 2**-0.5) for rate in rates)
    _train(model, optimizer, slice(None))
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    assert sharded.keys() == start.keys()
    for name, p in model.named_parameters():
        assert not torch.equal(p, start[name]), f"{name} did not train"
        torch.testing.assert_close(sharded[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
