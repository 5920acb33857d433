"""Context parallelism (``trainer.context_parallel``, ``yamlformer.recipes.parallel.context``): the load-balanced
shards, the attention over keys gathered from every rank (exact under causal masks, sliding
windows and RoPE: logits and gradients equal one process's), a recipe trained on CP 2 x 2
processes like one process step for step, a checkpoint resumed on another layout, and the
located refusals. The recipe runs are ``slow``; the model-level check on two processes is not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from recipe_helpers import tiny_recipe
from sharded_helpers import assert_same_losses, end_process_group, losses, recipe, train

from yamlformer.recipes.parallel.context import apply_context_parallel, load_balanced_index

ROOT = Path(__file__).resolve().parents[1]
SPECS = {  # causal RoPE GQA with a sliding window of 8 (crosses the 8-token chunks of a 32-token row) and without
    "window": ROOT / "specs" / "tiny" / "phi3.yaml",
    "causal": ROOT / "specs" / "tiny" / "llama.yaml",
}
#: and at the model level also sinks with a window and YaRN-scaled RoPE (GPT-OSS)
MODEL_SPECS = {**SPECS, "sinks": ROOT / "specs" / "tiny" / "gpt-oss.yaml"}


def test_load_balanced_shards_cover_the_sequence_once_each_rank_a_head_and_a_tail_chunk():
    shards = [load_balanced_index(16, r, 2).tolist() for r in range(2)]
    assert shards == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    four = torch.cat([load_balanced_index(32, r, 4) for r in range(4)])
    assert sorted(four.tolist()) == list(range(32))
    with pytest.raises(ValueError, match="2 x 4 equal chunks"):
        load_balanced_index(12, 0, 4)


def _worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from yamlformer.builder import build_model, load_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        for name, path in MODEL_SPECS.items():
            torch.manual_seed(0)  # the same weights and batch on every rank
            model = build_model(load_spec(path), attention_backend="sdpa")
            ids = torch.randint(0, model.spec.vocab_size, (2, 33))
            inputs, targets = ids[:, :-1], ids[:, 1:]
            whole = model(inputs)
            F.cross_entropy(whole.flatten(0, 1), targets.flatten()).backward()
            expected = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()

            shard = apply_context_parallel(model, mesh["cp"])
            local, local_targets = shard.split(inputs, targets)
            index = shard.token_index(inputs.shape[1], inputs.device)
            logits = model(local, token_index=index)
            F.cross_entropy(logits.flatten(0, 1), local_targets.flatten()).backward()
            torch.testing.assert_close(logits, whole.index_select(1, index), rtol=0, atol=1e-5, msg=name)
            for n, p in model.named_parameters():  # the mean over the ranks' shares: the whole row's
                dist.all_reduce(p.grad)
                torch.testing.assert_close(p.grad / world, expected[n], rtol=0, atol=1e-5, msg=f"{name} {n}")
    finally:
        end_process_group()


def test_context_parallel_attention_on_two_processes_gives_one_process_logits_and_gradients(tmp_path):
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


class _Mesh:  # what apply_context_parallel reads of a mesh before it asks for its group
    def size(self) -> int:
        return 2


@pytest.mark.parametrize("spec", ["diff-transformer", "deepseek-v2"])  # differential, multi-head latent
def test_an_attention_without_context_parallelism_is_refused_by_name(spec):
    from yamlformer.builder import build_model, load_spec
    from yamlformer.recipes.errors import RecipeError

    model = build_model(load_spec(ROOT / "specs" / "tiny" / f"{spec}.yaml"))
    with pytest.raises(
        RecipeError,
        match=r"trainer.context_parallel 2: decoder\.attention\.type: \w+ attention does not split its sequence",
    ):
        apply_context_parallel(model, _Mesh())


def test_a_head_with_attention_of_its_own_is_refused_by_its_field():
    """Multi-token prediction's layer attends over the whole sequence, which a rank's share is not:
    the head's own contract says so, as the planner reads it."""
    from yamlformer.builder import build_model, load_spec
    from yamlformer.recipes.errors import RecipeError

    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml", {"head": {"type": "mtp"}})
    with pytest.raises(RecipeError, match=r"trainer.context_parallel 2: head\.type: the mtp head runs attention"):
        apply_context_parallel(build_model(spec), _Mesh())


@pytest.mark.parametrize(
    ("sections", "where"),
    [
        ({"trainer": {"context_parallel": 2}}, "context_parallel needs strategy: fsdp"),
        ({"trainer": {"strategy": "fsdp", "devices": 2, "context_parallel": 2}, "data": {"seq_len": 30}}, "seq_len 30"),
        (
            {"trainer": {"strategy": "fsdp", "devices": 2, "context_parallel": 2}, "data": {"packing": "doc_masked"}},
            "packing doc_masked",
        ),
        ({"trainer": {"strategy": "fsdp", "devices": 3, "context_parallel": 2}}, "must divide devices"),
    ],
)
def test_a_context_parallel_recipe_that_cannot_run_is_refused_at_its_line(tmp_path, sections, where):
    from yamlformer.builder.spec.source import SpecError
    from yamlformer.recipes.tasks import load_recipe

    path = tiny_recipe(tmp_path, **sections)
    with pytest.raises(SpecError) as caught:
        load_recipe(path)
    assert where in str(caught.value)
    assert f"{path.name}:" in str(caught.value)  # located in the recipe file


# -- slow: recipes trained on CP 2 x 2 processes -----------------------------------------------------


#: a mixture of experts too: its balancing loss is the whole micro-batch's, its statistics summed
#: over both shares of every sequence (``yamlformer.blocks.experts.balance_statistics``), as one process counts them
TRAINED = {**SPECS, "experts": ROOT / "specs" / "tiny" / "mixtral.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINED))
def test_context_parallel_two_trains_like_one_process_step_for_step(name, tmp_path):
    spec = str(TRAINED[name])
    out = train(
        recipe(tmp_path / "cp", batch=4, devices=2, spec=spec, strategy="fsdp", context_parallel=2, log_every_n_steps=1)
    )
    assert "MEMBER: 2/2" in out
    train(recipe(tmp_path / "one", batch=4, spec=spec, log_every_n_steps=1))
    cp, one = losses(tmp_path / "cp" / "run"), losses(tmp_path / "one" / "run")
    assert len(cp["train"]) == 20  # every step's loss
    assert_same_losses(cp, one, atol=2e-5)


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_on_another_layout_like_an_unbroken_run(tmp_path):
    train(recipe(tmp_path / "one", batch=4, log_every_n_steps=1))
    moved = tmp_path / "moved"
    train(recipe(moved, batch=4, devices=2, strategy="fsdp", context_parallel=2, steps=10, log_every_n_steps=1))
    out = train(recipe(moved, batch=2, devices=2, strategy="fsdp", log_every_n_steps=1))  # CP 2 -> FSDP 2
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), losses(tmp_path / "one" / "run"))
    back = tmp_path / "back"  # and FSDP 2 -> CP 2
    train(recipe(back, batch=2, devices=2, strategy="fsdp", steps=10, log_every_n_steps=1))
    out = train(recipe(back, batch=4, devices=2, strategy="fsdp", context_parallel=2, log_every_n_steps=1))
    assert "resuming from" in out
    assert_same_losses(losses(back / "run"), losses(tmp_path / "one" / "run"))


@pytest.mark.slow
def test_context_parallel_composes_with_tensor_parallel_and_clipping_on_four_processes(tmp_path):
    from test_sharded import TINY_TP

    settings = {"spec": TINY_TP, "gradient_clip_val": 1.0, "log_every_n_steps": 1}
    vocab = ("--set", "tokenizer.type=sentencepiece", "--set", "tokenizer.vocab_size=400")  # 95 chars do not split
    train(recipe(tmp_path / "one", batch=4, **settings), *vocab)
    layout = {"devices": 4, "strategy": "fsdp", "context_parallel": 2, "tensor_parallel": 2}
    out = train(recipe(tmp_path / "cp-tp", batch=4, **layout, **settings), *vocab)
    assert_same_losses(losses(tmp_path / "cp-tp" / "run"), losses(tmp_path / "one" / "run"))
    assert "sequential all_reduce" not in out  # the clipped norm over (dp_shard_cp, tp): one all-reduce
