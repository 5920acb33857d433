"""Expert parallelism (``trainer.expert_parallel``) on CPU processes (gloo): the stacked experts of
DeepSeekMoE and of the Mixtral-like ``moe`` (GPT-OSS's router bias, expert biases and clamp among
them) split over the ``ep`` ranks, tokens dispatched and combined by all-to-all. Every rank holds
what ``builder describe --expert-parallel`` counts and computes the whole model's loss and gradients;
training equals one process seeing the same micro-batches, and a checkpoint resumes across the two;
the layouts it cannot run are refused at their line. The training runs are ``slow``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from recipe_helpers import tiny_recipe
from sharded_helpers import assert_same_losses, end_process_group, losses, recipe, train

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SEED = 7


def _spec(name: str):
    from yamlformer.builder.spec.loader import load_spec

    return load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml")


def _sharded(rank: int, world: int, store: str, spec, **layout):
    """Join the ``world`` processes' group and return ``spec`` built on meta and parallelised as
    ``trainer`` with ``layout`` (fsdp, fp32) lays it out, each rank drawing its own shards."""
    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.parallel import parallelize
    from yamlformer.recipes.parallel.mesh import device_mesh, layout_of
    from yamlformer.recipes.recipe.sections import TrainerSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    settings = TrainerSection(strategy="fsdp", accelerator="cpu", devices=world, precision="32", **layout)
    model = build_model(spec, device="meta")
    return parallelize(
        model, settings, device_mesh(layout_of(settings), "cpu"), init_seed=SEED, device=torch.device("cpu")
    )


def _worker(rank: int, world: int, name: str, store: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from yamlformer.builder.assemble import build_model

    spec = _spec(name)
    model = _sharded(rank, world, store, spec, expert_parallel=world)
    whole = build_model(spec, init_seed=SEED)  # the single-process start

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    exact = all(torch.equal(full(p), whole.get_parameter(n)) for n, p in model.named_parameters())
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and "ep" in p.device_mesh.mesh_dim_names]

    def loss_of(m, ids):
        return m(ids).float().logsumexp(-1).mean()

    batches = [
        torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(r)) for r in range(world)
    ]
    loss = loss_of(model, batches[rank])
    loss.backward()
    reference = [loss_of(whole, ids) for ids in batches]
    (sum(reference) / world).backward()  # FSDP2 averages the ranks' gradients
    grads = [(p.grad, whole.get_parameter(n).grad) for n, p in model.named_parameters()]
    grads_equal = all(
        (a is None and b is None) or torch.allclose(full(a), b, rtol=0, atol=1e-6) for a, b in grads
    ) and any(a is not None for a, _ in grads)
    held = {
        "exact": exact,
        "loss": abs(loss.item() - reference[rank].item()),
        "grads_equal": grads_equal,
        "split": split,
        **_held_bytes(model),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(held))
    end_process_group()


def _held_bytes(model) -> dict[str, int]:
    """The bytes of weights, gradients and AdamW state this rank holds (after one step), and its tensors."""
    from torch.distributed.tensor import DTensor

    from yamlformer.builder.optim.configs import AdamWConfig
    from yamlformer.recipes.optim import param_groups

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(model.parameters())
    for p in params:  # the multi-token-prediction module is not in the logits' graph
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(param_groups(AdamWConfig(weight_decay=0.1), model), lr=1e-3)
    optimizer.step()
    return {
        "weights": sum(local(p).numel() * local(p).element_size() for p in params),
        "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params),
        "optimizer": sum(
            local(s).numel() * local(s).element_size() for p in params for s in optimizer.state[p].values()
        ),
        "tensors": len(params),
    }


def _counted(spec, layout, rank: int) -> dict[str, int]:
    """What ``yamlformer.builder.analysis.layout.rank_states`` counts of ``rank``, as :func:`_held_bytes` reports it."""
    from yamlformer.builder.analysis.layout import rank_states

    want = rank_states(spec, layout, rank)
    return {"weights": want.weights, "gradients": want.gradients, "optimizer": want.optimizer, "tensors": want.tensors}


def _layout_worker(rank: int, world: int, cp: int, ep: int, store: str, out: str) -> None:
    """The bytes this rank holds under EP ``ep`` x CP ``cp`` on ``world`` processes."""
    model = _sharded(rank, world, store, _spec("mixtral"), context_parallel=cp, expert_parallel=ep)
    Path(out, f"{rank}.json").write_text(json.dumps(_held_bytes(model)))
    end_process_group()


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.slow) for name in ("deepseek-v3", "mixtral", "gpt-oss")],  # 14 s each
)
def test_every_ep_rank_holds_what_describe_counts_and_computes_the_whole_models_loss_and_gradients(
    name, tmp_path, capsys
):
    from yamlformer.builder.analysis.layout import Layout, rank_states
    from yamlformer.builder.cli import main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, name, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    spec, layout = _spec(name), Layout(devices=2, expert_parallel=2)
    for rank in (1, 0):
        held = json.loads((tmp_path / f"{rank}.json").read_text())
        assert held.pop("exact") and held.pop("grads_equal") and held.pop("loss") < 1e-6, rank
        # the stacked routed experts (every MoE layer's, DeepSeek-V3's multi-token-prediction layer's) are split
        split = held.pop("split")
        assert split and all(".ffn.experts." in name for name in split), split
        assert held == _counted(spec, layout, rank), f"rank {rank}"
    # builder describe prints that count for rank 0: half the experts, half of every dense tensor
    capsys.readouterr()
    args = ["describe", str(ROOT / f"specs/tiny/{name}.yaml"), "--devices", "2", "--strategy", "fsdp"]
    assert main([*args, "--expert-parallel", "2", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["layout"]["expert_parallel"] == 2
    assert (
        (memory["weights"], memory["optimizer"])
        == (held["weights"], held["optimizer"])
        == (
            rank_states(spec, layout, 0).weights,
            rank_states(spec, layout, 0).optimizer,
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_under_context_parallelism_every_ep_rank_holds_what_describe_counts(ep, tmp_path):
    """EP 2 (the context-parallel pair; experts FSDP-sharded over the other pair) and EP 4 (the
    pair and both data-parallel ranks) with CP 2 on 4 processes: each rank's bytes, as counted."""
    from yamlformer.builder.analysis.layout import Layout

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_layout_worker, args=(4, 2, ep, str(tmp_path / "store"), str(tmp_path)), nprocs=4)
    spec, layout = _spec("mixtral"), Layout(devices=4, context_parallel=2, expert_parallel=ep)
    for rank in range(4):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == _counted(spec, layout, rank), f"rank {rank}"


# -- refusals, before any work ---------------------------------------------------------------------


def _refused(tmp_path, capsys, needles, spec=None, **trainer) -> None:
    from yamlformer.builder.cli import main

    sections = {"trainer": trainer}
    if spec is not None:
        sections["model"] = {"spec": spec}
    tmp_path.mkdir()
    path = tiny_recipe(tmp_path, **sections)
    assert main(["train", str(path)]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    err = "\n".join(lines)
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not list((tmp_path / "cache").rglob("*.bin"))  # before tokenizing the corpus


def test_layouts_expert_parallelism_cannot_run_are_refused_at_their_line(tmp_path, capsys):
    v3 = str(ROOT / "specs/tiny/deepseek-v3.yaml")
    _refused(tmp_path / "a", capsys, ["recipe.yaml:", "trainer.expert_parallel", "strategy: fsdp"], expert_parallel=2)
    _refused(
        tmp_path / "b",
        capsys,
        ["trainer.expert_parallel", "replicate"],
        spec=v3,
        strategy="fsdp",
        devices=2,
        data_parallel="replicate",
        expert_parallel=2,
    )
    _refused(
        tmp_path / "c",
        capsys,
        ["trainer.expert_parallel 4", "shard group of 2"],
        spec=v3,
        strategy="fsdp",
        devices=2,
        expert_parallel=4,
    )
    # the spec's fields, located: an expert count 3 does not divide, a dense model
    _refused(
        tmp_path / "e",
        capsys,
        ["deepseek-v3.yaml:", "decoder.ffn.n_experts", "expert-parallel degree 3"],
        spec=v3,
        strategy="fsdp",
        devices=3,
        expert_parallel=3,
    )
    _refused(tmp_path / "f", capsys, ["no experts"], strategy="fsdp", devices=2, expert_parallel=2)
    # with context parallelism the expert group takes the context-parallel ranks first: a degree
    # that is not a multiple of theirs is refused at expert_parallel, before any work
    _refused(
        tmp_path / "g",
        capsys,
        ["recipe.yaml:", "trainer.expert_parallel", "context_parallel 4", "must be a multiple of context_parallel"],
        spec=v3,
        strategy="fsdp",
        devices=8,
        context_parallel=4,
        expert_parallel=2,
    )


def test_the_mesh_borrows_expert_ranks_from_context_then_data_parallel_ones():
    from yamlformer.builder.analysis.layout import Layout
    from yamlformer.recipes.parallel.mesh import MESH_DIMS, expert_dims, mesh_shape

    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
    assert mesh_shape(Layout(devices=8, tensor_parallel=2, expert_parallel=2)) == (1, 1, 2, 2, 1, 2)
    assert mesh_shape(Layout(devices=8, tensor_parallel=2, context_parallel=2)) == (1, 1, 2, 1, 2, 2)
    assert mesh_shape(Layout(devices=8, nodes=2, data_parallel="hybrid", expert_parallel=2)) == (1, 2, 2, 2, 1, 1)
    # EP 2 x CP 2: the expert group is the context-parallel pair; EP 4 x CP 2 takes 2 data-parallel ranks too
    assert mesh_shape(Layout(devices=4, context_parallel=2, expert_parallel=2)) == (1, 1, 2, 1, 2, 1)
    assert mesh_shape(Layout(devices=8, context_parallel=2, expert_parallel=4)) == (1, 1, 2, 2, 2, 1)
    assert expert_dims(Layout(devices=8, context_parallel=2, expert_parallel=4)) == ("dp_shard_in_ep", "cp")
    assert expert_dims(Layout(devices=8, context_parallel=2)) == ("dp_shard_in_ep",)  # ep is 1: not the cp ranks


def test_expert_parallel_with_context_parallel_is_a_multiple_of_it():
    from yamlformer.recipes.recipe.sections import TrainerSection

    with pytest.raises(ValueError, match="expert_parallel 2 with context_parallel 4: .* multiple of context_parallel"):
        TrainerSection(strategy="fsdp", accelerator="cpu", devices=8, context_parallel=4, expert_parallel=2)
    for ep, cp in ((2, 1), (1, 2), (2, 2), (4, 2)):
        TrainerSection(strategy="fsdp", accelerator="cpu", devices=8, context_parallel=cp, expert_parallel=ep)


# -- slow: training ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3", "mixtral", "gpt-oss"])
def test_expert_parallel_on_two_processes_trains_like_one_accumulating_two(name, tmp_path):
    # each rank reads its own micro-batch (EP borrows data-parallel ranks) and the balancing loss is a
    # statistic of each micro-batch, as under data parallelism: one process accumulating the same two
    # (the same global batch of 4) is the reference
    spec = str(ROOT / "specs" / "tiny" / f"{name}.yaml")
    train(recipe(tmp_path / "ep", batch=2, devices=2, strategy="fsdp", expert_parallel=2, spec=spec))
    train(recipe(tmp_path / "one", batch=2, spec=spec, accumulate_grad_batches=2))
    assert_same_losses(losses(tmp_path / "ep" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
def test_expert_parallel_2_x_fsdp_2_on_four_processes_trains_like_one_accumulating_four(tmp_path):
    # the experts split over ep and FSDP-sharded over the other 2 ranks (a 2-D DTensor)
    spec = str(ROOT / "specs" / "tiny" / "deepseek-v3.yaml")
    train(recipe(tmp_path / "ep", batch=2, devices=4, strategy="fsdp", expert_parallel=2, spec=spec, steps=10))
    train(recipe(tmp_path / "one", batch=2, spec=spec, accumulate_grad_batches=4, steps=10))
    assert_same_losses(losses(tmp_path / "ep" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral"])
def test_an_expert_parallel_checkpoint_resumes_on_one_process_and_back(name, tmp_path):
    spec = str(ROOT / "specs" / "tiny" / f"{name}.yaml")
    train(recipe(tmp_path / "one", batch=2, spec=spec, accumulate_grad_batches=2))
    reference = losses(tmp_path / "one" / "run")
    ep = dict(batch=2, devices=2, strategy="fsdp", expert_parallel=2, spec=spec)
    one = dict(batch=2, spec=spec, accumulate_grad_batches=2)
    moved = tmp_path / "moved"  # EP 2 for 10 steps, then one process to 20
    train(recipe(moved, steps=10, **ep))
    assert "resuming from" in train(recipe(moved, **one))
    assert_same_losses(losses(moved / "run"), reference, keys=("train",))
    back = tmp_path / "back"  # one process for 10 steps, then EP 2 to 20
    train(recipe(back, steps=10, **one))
    assert "resuming from" in train(recipe(back, **ep))
    assert_same_losses(losses(back / "run"), reference, keys=("train",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "gpt-oss"])  # top-2 of 8 experts; sinks in a sliding window
def test_expert_parallel_over_the_context_parallel_pair_trains_like_one_process(name, tmp_path):
    # EP 2 x CP 2 on 2 processes: the expert group is the two shares of every sequence, one
    # data-parallel rank reading the whole batch, as one process does
    spec = str(ROOT / "specs" / "tiny" / f"{name}.yaml")
    layout = dict(devices=2, strategy="fsdp", context_parallel=2, expert_parallel=2, log_every_n_steps=1)
    out = train(recipe(tmp_path / "ep-cp", batch=4, spec=spec, **layout))
    train(recipe(tmp_path / "one", batch=4, spec=spec, log_every_n_steps=1))
    assert_same_losses(losses(tmp_path / "ep-cp" / "run"), losses(tmp_path / "one" / "run"))
    # no warning a user must read: the experts' views (read out of place), their 2-D gather at the end
    assert "Warning" not in out and "sequential all_gather" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_with_context_parallel_on_four_processes_trains_like_one_accumulating_two(ep, tmp_path):
    # CP 2 x 2 data-parallel ranks: EP 2 is the context-parallel pair (the experts FSDP-sharded
    # over the other pair), EP 4 borrows both data-parallel ranks too (ep = dp_shard_in_ep x cp)
    spec = str(ROOT / "specs" / "tiny" / "mixtral.yaml")
    layout = dict(devices=4, strategy="fsdp", context_parallel=2, expert_parallel=ep, steps=10)
    train(recipe(tmp_path / "ep-cp", batch=2, spec=spec, **layout))
    train(recipe(tmp_path / "one", batch=2, spec=spec, accumulate_grad_batches=2, steps=10))
    assert_same_losses(losses(tmp_path / "ep-cp" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))
