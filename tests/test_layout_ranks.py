"""yamlformer.builder.analysis.layout against PyTorch itself: a model built from a spec, split with DTensor's
tensor-parallel styles as each block's ``parallel_plan`` says and sharded with FSDP2's
``fully_shard`` on CPU processes (gloo), holds on every rank exactly the parameter, gradient and
AdamW-state elements ``rank_states`` counts. Slow (several processes start torch): run with
``pytest -m slow``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharded_helpers import end_process_group

from yamlformer.builder.analysis.layout import Layout, model_tensors, rank_states
from yamlformer.builder.spec.schema import spec_model

pytestmark = pytest.mark.slow

#: dims that do not divide the shard groups evenly: ranks hold different shares
SPEC = {
    "name": "odd",
    "architecture": "decoder-only",
    "vocab_size": 250,
    "d_model": 24,
    "max_seq_len": 32,
    "position": {"type": "learned"},
    "tie_embeddings": False,
    "decoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True, "out_bias": True},
        "ffn": {"type": "mlp", "hidden_dim": 70, "bias": True},
        "norm": {"type": "layernorm"},
    },
}


def _worker(rank: int, world: int, nodes: int, tp: int, mode: str, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from yamlformer.builder.assemble import build_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    layout = Layout(devices=world, nodes=nodes, tensor_parallel=tp, data_parallel=mode)
    mesh = init_device_mesh(
        "cpu", (layout.replicas, layout.shard_size, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    spec = spec_model().model_validate(SPEC)
    torch.manual_seed(0)
    model = build_model(spec)
    if tp > 1:  # each tensor's split as yamlformer.builder.analysis.layout reads it from the blocks' plans
        styles = {0: ColwiseParallel(), 1: RowwiseParallel()}
        plan = {}
        for tensor in model_tensors(spec):
            module = tensor.name.rpartition(".")[0]
            if tensor.tp_dim is not None and tensor.name.endswith("weight"):
                embedding = module.endswith("embedding.tokens")
                plan[module] = RowwiseParallel() if embedding else styles[tensor.tp_dim]
        parallelize_module(model, mesh["tp"], plan)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.replicas > 1 else mesh["dp_shard"]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    for unit in (model.decoder.embedding, model.head):
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the sharded gradient FSDP2 leaves: the parameter's local shape
    optimizer.step()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(model.parameters())
    held = {
        "elements": sum(local(p).numel() for p in params),
        "weights": sum(local(p).numel() * local(p).element_size() for p in params),
        "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params),
        "optimizer": sum(
            local(s).numel() * local(s).element_size() for p in params for s in optimizer.state[p].values()
        ),
        "tensors": len(params),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(held))
    end_process_group()


@pytest.mark.parametrize("world, nodes, tp, mode", [(3, 1, 1, "shard"), (4, 1, 2, "shard"), (4, 2, 1, "hybrid")])
def test_every_rank_holds_what_rank_states_counts(world, nodes, tp, mode, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, nodes, tp, mode, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    spec = spec_model().model_validate(SPEC)
    layout = Layout(devices=world, nodes=nodes, tensor_parallel=tp, data_parallel=mode)
    counted = [rank_states(spec, layout, rank) for rank in range(world)]
    for rank in range(world):
        held = json.loads((tmp_path / f"{rank}.json").read_text())
        want = counted[rank]
        assert held == {
            "elements": want.elements,
            "weights": want.weights,
            "gradients": want.gradients,
            "optimizer": want.optimizer,
            "tensors": want.tensors,
        }, f"rank {rank}"
    if layout.shard_size == 3:
        assert len({c.elements for c in counted}) == 2  # 250 rows over 3 ranks: 84, 84, 82
