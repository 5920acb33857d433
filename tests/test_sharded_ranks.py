"""The recipe's own sharding (``yamlformer.recipes.parallel.parallelize`` on a mesh: the blocks' tensor-parallel plans,
``fully_shard`` units, a meta-device start) against ``yamlformer.builder.analysis.layout``, on CPU processes (gloo):
after a real training step every rank holds exactly the parameter, gradient and AdamW-state
bytes ``rank_states`` (what ``builder describe --devices/--strategy/--tensor-parallel`` prints)
counts, and every parameter it materialised equals a whole-model build's start value. Slow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharded_helpers import end_process_group
from test_layout_ranks import SPEC as ODD

from yamlformer.builder.analysis.layout import Layout, rank_states
from yamlformer.builder.spec.schema import spec_model

pytestmark = pytest.mark.slow

#: dims that do not divide the shard groups evenly (ranks hold different shares), here with a tied head
SPEC = {**ODD, "tie_embeddings": True}
SEED = 7


def _worker(rank: int, world: int, nodes: int, tp: int, mode: str, store: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.optim.configs import AdamWConfig
    from yamlformer.recipes.optim import param_groups
    from yamlformer.recipes.parallel import layout_of, parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    settings = TrainerSection(
        strategy="fsdp",
        accelerator="cpu",
        devices=world // nodes,
        num_nodes=nodes,
        tensor_parallel=tp,
        data_parallel=mode,
        precision="bf16-mixed",
    )
    layout = layout_of(settings)
    mesh = device_mesh(layout, "cpu")
    spec = spec_model().model_validate(SPEC)
    model = parallelize(build_model(spec, device="meta"), settings, mesh, init_seed=SEED, device=torch.device("cpu"))

    whole = build_model(spec, init_seed=SEED)  # the single-process start
    exact = all(
        torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, whole.get_parameter(name))
        for name, p in model.named_parameters()
    )

    optimizer = torch.optim.AdamW(param_groups(AdamWConfig(weight_decay=0.1), model, spec), lr=1e-3)
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank // tp))
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(model.parameters())
    held = {
        "exact": exact,
        "weights": sum(local(p).numel() * local(p).element_size() for p in params),
        "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params),
        "optimizer": sum(
            local(s).numel() * local(s).element_size() for p in params for s in optimizer.state[p].values()
        ),
        "tensors": len(params),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(held))
    end_process_group()


@pytest.mark.parametrize(
    "world, nodes, tp, mode", [(3, 1, 1, "shard"), (4, 1, 2, "shard"), (4, 2, 1, "hybrid"), (2, 1, 2, "replicate")]
)
def test_every_rank_holds_what_describe_counts_and_starts_where_one_process_does(world, nodes, tp, mode, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, nodes, tp, mode, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    spec = spec_model().model_validate(SPEC)
    layout = Layout(devices=world, nodes=nodes, tensor_parallel=tp, data_parallel=mode)
    for rank in range(world):
        held = json.loads((tmp_path / f"{rank}.json").read_text())
        want = rank_states(spec, layout, rank)
        assert held == {
            "exact": True,
            "weights": want.weights,
            "gradients": want.gradients,
            "optimizer": want.optimizer,
            "tensors": want.tensors,
        }, f"rank {rank}"
