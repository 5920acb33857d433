"""Pipeline parallelism (``trainer.pipeline_parallel``) on CPU processes (gloo): the model's
stage contract, each schedule training like one process at the same global batch, checkpoints
resuming on another layout, PP x FSDP; bad settings refused in one located line. The
multi-process runs beyond the first are ``slow``."""

from __future__ import annotations

import pytest
import torch
from recipe_helpers import tiny_recipe
from sharded_helpers import assert_same_losses, losses, recipe, train

torch.set_num_threads(1)

#: four layers (two stages of two, or four of one), an untied head (a tied one would span stages)
TINY_PP = {
    "name": "tiny-pp",
    "architecture": "decoder-only",
    "d_model": 32,
    "max_seq_len": 32,
    "tie_embeddings": False,
    "position": {"type": "rope"},
    "decoder": {
        "n_layers": 4,
        "attention": {"n_heads": 2},
        "ffn": {"type": "glu", "hidden_dim": 64},
        "norm": {"type": "rmsnorm"},
    },
}


def _pp(folder, schedule: str = "1f1b", devices: int = 2, batch: int = 4, microbatches: int = 2, **trainer):
    return recipe(
        folder,
        batch=batch,
        devices=devices,
        spec=TINY_PP,
        strategy="fsdp",
        pipeline_parallel=2,
        pipeline_schedule=schedule,
        microbatches=microbatches,
        **trainer,
    )


# -- the default suite ----------------------------------------------------------------------------


def test_stages_chained_compute_the_whole_model_and_keep_its_parameter_names():
    from yamlformer.builder import build_model
    from yamlformer.recipes.parallel.pipeline import stage_layers, stages_of_rank

    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(5, 3) == [[0, 1], [2, 3], [4]]  # extras: the middle first, then the first; the last fewest
    assert stage_layers(6, 4) == [[0], [1, 2], [3, 4], [5]]
    assert [stages_of_rank(r, 2, 2, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stages_of_rank(r, 2, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]

    model = build_model(dict(TINY_PP, vocab_size=64), init_seed=0)
    ids = torch.randint(0, 64, (2, 8))
    names = dict(model.named_parameters())
    hidden = ids
    for layers in stage_layers(4, 4):
        part = model.pipeline_part(layers)
        for name, p in part.named_parameters():
            assert names[name] is p, name  # shared, under the whole model's name
        hidden = part(hidden)
    torch.testing.assert_close(hidden, model(ids), rtol=0, atol=0)
    rank = model.pipeline_part([0, 3])  # a V placement's rank: the embedding and the head
    assert rank.decoder.embedding is not None and rank.head is not None
    assert rank.pipeline_part([3]).decoder.embedding is None and rank.pipeline_part([0]).head is None


def test_a_resume_in_the_other_optimization_mode_keeps_the_saved_step_count():
    """A pipelined run counts optimizer steps in Lightning's manual loop, others in the automatic
    one; a resume in the other mode reads its own counter, which the checkpoint must carry."""
    from lightning.pytorch.loops.progress import _OptimizationProgress, _Progress, _ReadyCompletedTracker

    from yamlformer.recipes.learning.module import AUTOMATIC_STEPS, MANUAL_STEPS, carry_optimizer_steps

    def saved(automatic: bool, steps: int) -> dict:
        auto, manual = _OptimizationProgress(), _Progress.from_defaults(_ReadyCompletedTracker)
        for _ in range(steps):
            if automatic:
                auto.optimizer.step.increment_ready()
                auto.optimizer.step.increment_completed()
            else:
                manual.increment_ready()
                manual.increment_completed()
        return {"loops": {"fit_loop": {AUTOMATIC_STEPS: auto.state_dict(), MANUAL_STEPS: manual.state_dict()}}}

    pipelined = saved(automatic=False, steps=10)
    carry_optimizer_steps(pipelined, automatic=True)
    auto = _OptimizationProgress()
    auto.load_state_dict(pipelined["loops"]["fit_loop"][AUTOMATIC_STEPS])
    assert auto.optimizer_steps == 10
    one = saved(automatic=True, steps=7)
    carry_optimizer_steps(one, automatic=False)
    assert one["loops"]["fit_loop"][MANUAL_STEPS]["total"]["completed"] == 7
    same = saved(automatic=True, steps=3)
    carry_optimizer_steps(same, automatic=True)  # the mode it was saved in: untouched
    assert same == saved(automatic=True, steps=3)


@pytest.mark.parametrize(
    "layout",
    [
        {"devices": 8, "tensor_parallel": 2, "pipeline_parallel": 2},
        {"devices": 8, "pipeline_parallel": 2, "data_parallel": "replicate"},
        {"devices": 8, "nodes": 4, "pipeline_parallel": 2, "data_parallel": "hybrid"},
        {"devices": 8, "tensor_parallel": 2, "context_parallel": 2},
        {"devices": 8, "tensor_parallel": 2, "expert_parallel": 2},
        {"devices": 8, "context_parallel": 2, "expert_parallel": 4},
    ],
)
def test_the_runtime_mesh_numbers_ranks_as_the_layout_model_does(layout):
    """``init_device_mesh`` lays rank ``r`` at ``unravel_index(r, mesh_shape)``: each rank's
    coordinates on the ``(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)`` mesh are those
    ``yamlformer.builder.analysis.layout`` gives it (the shard coordinate spans
    ``dp_shard_mod_ep x dp_shard_in_ep``)."""
    from yamlformer.builder.analysis.layout import Layout
    from yamlformer.recipes.parallel.mesh import MESH_DIMS, mesh_shape

    model = Layout(**layout)
    shape = mesh_shape(model)
    grid = torch.arange(model.devices).reshape(shape)
    for rank in range(model.devices):
        at = dict(zip(MESH_DIMS, (int(i) for i in torch.nonzero(grid == rank)[0]), strict=True))
        expected = model.mesh(rank)
        shard = at["dp_shard_mod_ep"] * shape[MESH_DIMS.index("dp_shard_in_ep")] + at["dp_shard_in_ep"]
        got = {"pp": at["pp"], "replicate": at["dp_replicate"], "shard": shard, "cp": at["cp"], "tp": at["tp"]}
        assert got == expected, (rank, got, expected)


@pytest.mark.parametrize(
    "trainer, needles",
    [
        ({"pipeline_parallel": 2, "devices": 2}, ["trainer.pipeline_parallel", "needs strategy: fsdp"]),
        ({"pipeline_parallel": 2, "devices": 3, "strategy": "fsdp"}, ["must divide the 3 devices"]),
        ({"microbatches": 2}, ["trainer.microbatches", "needs pipeline_parallel > 1"]),
        (
            {"pipeline_parallel": 2, "devices": 2, "strategy": "fsdp", "microbatches": 3},
            ["trainer.microbatches", "3 pipeline micro-batches must divide data.batch_size 4"],
        ),
        (
            {"pipeline_parallel": 2, "devices": 2, "strategy": "fsdp", "pipeline_schedule": "dualpipev"},
            ["trainer.microbatches", "dualpipev needs at least as many micro-batches as stages: 2 for 4"],
        ),
        (
            {"pipeline_parallel": 2, "devices": 2, "strategy": "fsdp", "accumulate_grad_batches": 2},
            ["trainer.accumulate_grad_batches", "microbatches"],
        ),
    ],
)
def test_pipeline_settings_that_cannot_run_are_refused_at_their_line(tmp_path, capsys, trainer, needles):
    from yamlformer.builder.cli import main

    path = tiny_recipe(tmp_path, trainer=trainer)
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "recipe.yaml:" in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    "spec, schedule, needle",
    [
        # the tiny spec ties its head to the embedding: the first and last stages on one rank cannot hold it twice
        (
            {"decoder": dict(TINY_PP["decoder"], n_layers=4)},
            "zbv",
            "tie_embeddings: a head tied to the embedding needs the first and last stages on different ranks",
        ),
        (
            {"tie_embeddings": False, "decoder": dict(TINY_PP["decoder"], n_layers=1)},
            "1f1b",
            "2 stages but the model has 1",
        ),
        ({"tie_embeddings": False, "head": {"type": "mtp"}}, "1f1b", "head.type: the mtp head's own losses"),
    ],
)
def test_a_model_its_stages_cannot_cut_is_refused_before_any_data_work(tmp_path, capsys, spec, schedule, needle):
    from recipe_helpers import TINY_SPEC

    from yamlformer.builder.cli import main

    trainer = {"pipeline_parallel": 2, "devices": 2, "strategy": "fsdp", "pipeline_schedule": schedule}
    path = tiny_recipe(tmp_path, model={"spec": {**TINY_SPEC, **spec}}, trainer=trainer)
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "trainer.pipeline_parallel 2" in err, err
    assert needle in err, err
    assert not list((tmp_path / "cache").rglob("*.bin"))  # before tokenizing the corpus


@pytest.mark.slow  # two runs, about 30 s: the default suite keeps the contract test and the refusals
def test_pipeline_on_two_processes_trains_like_one(tmp_path):
    train(_pp(tmp_path / "pp", steps=6))
    train(recipe(tmp_path / "one", batch=4, spec=TINY_PP, steps=6))
    assert_same_losses(losses(tmp_path / "pp" / "run"), losses(tmp_path / "one" / "run"))


# -- slow: every schedule, resumes, PP x FSDP ----------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run every layout below is compared with (20 steps, batch 4)."""
    folder = tmp_path_factory.mktemp("one")
    train(recipe(folder, batch=4, spec=TINY_PP))
    return losses(folder / "run")


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, microbatches",
    [("gpipe", 2), ("1f1b", 4), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zbv", 2), ("dualpipev", 4)],
)
def test_every_schedule_on_two_processes_trains_like_one(tmp_path, one_process, schedule, microbatches):
    train(_pp(tmp_path, schedule, microbatches=microbatches))
    assert_same_losses(losses(tmp_path / "run"), one_process)


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, then",
    [("1f1b", "interleaved_1f1b"), ("zbv", "1f1b")],  # then: looped stages; from a V's: each rank holds other layers
)
def test_a_pipelined_run_resumes_on_another_layout(tmp_path, one_process, first, then):
    moved = tmp_path / "moved"
    train(_pp(moved, first, steps=10))
    out = train(_pp(moved, then))
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), one_process)


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_in_one_process(tmp_path, one_process):
    """PP 2 for 10 steps, then one process to 20 (the sharded folder read whole): every
    parameter's optimizer state by the whole model's name, the step count carried from the
    manual loop the pipeline steps in to the automatic one."""
    moved = tmp_path / "moved"
    train(_pp(moved, steps=10))
    out = train(recipe(moved, batch=4, spec=TINY_PP))
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), one_process)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_pipelined(tmp_path, one_process):
    """One process for 10 steps, then PP 2 to 20 (the file read into each stage's shards by the
    whole model's parameter positions)."""
    moved = tmp_path / "moved"
    train(recipe(moved, batch=4, spec=TINY_PP, steps=10))
    out = train(_pp(moved))
    assert "resuming from" in out
    assert_same_losses(losses(moved / "run"), one_process)


@pytest.mark.slow
def test_pipeline_x_fsdp_on_four_processes_trains_like_one(tmp_path, one_process):
    out = train(_pp(tmp_path, devices=4, batch=2, microbatches=2))  # 2 stages x 2 shards, batch 2 per shard
    assert "MEMBER: 4/4" in out
    assert_same_losses(losses(tmp_path / "run"), one_process, keys=("train",))


# -- slow: stages holding experts ---------------------------------------------------------------------


def _moe_spec(folder, name: str, n_layers: int | None = None, **changes) -> str:
    """A tiny MoE spec of ``specs/tiny`` with an untied head (a tied one would span the stages)."""
    from pathlib import Path

    import yaml

    tiny = Path(__file__).resolve().parents[1] / "specs" / "tiny"
    spec = yaml.safe_load((tiny / f"{name}.yaml").read_text())
    spec["extends"] = str((tiny / spec["extends"]).resolve())
    spec.update(tie_embeddings=False, **changes)
    if n_layers is not None:
        spec["decoder"]["n_layers"] = n_layers
    path = folder / f"{name}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.slow
def test_stages_add_their_own_layers_balancing_losses(tmp_path):
    """A Mixtral-like model on 2 stages: each stage's balancing loss enters its own backward, so
    the step is one process's accumulating the same two micro-batches (each loss a statistic of
    its micro-batch)."""
    spec = _moe_spec(tmp_path, "mixtral")
    train(recipe(tmp_path / "pp", batch=4, devices=2, spec=spec, strategy="fsdp", pipeline_parallel=2, steps=10))
    train(recipe(tmp_path / "one", batch=2, spec=spec, accumulate_grad_batches=2, steps=10))
    assert_same_losses(losses(tmp_path / "pp" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
def test_pipeline_2_x_expert_parallel_2_on_four_processes_trains_like_one(tmp_path):
    """DeepSeek-V3-like, three layers (the first dense), LM head: two stages, each holding a
    DeepSeekMoE layer split over 2 expert-parallel ranks; the routing bias moves by the loads its
    stage's ranks saw (summed over them alone, not over the other stage's layer) and torch's
    metadata inference before the first step counts none; one process accumulating the same four
    micro-batches of one sequence is the reference."""
    spec = _moe_spec(tmp_path, "deepseek-v3", n_layers=3, head={"type": "lm"})
    layout = dict(devices=4, strategy="fsdp", pipeline_parallel=2, expert_parallel=2, microbatches=2)
    out = train(recipe(tmp_path / "ppep", batch=2, spec=spec, steps=10, **layout))
    assert "MEMBER: 4/4" in out
    train(recipe(tmp_path / "one", batch=1, spec=spec, accumulate_grad_batches=4, steps=10))
    assert_same_losses(losses(tmp_path / "ppep" / "run"), losses(tmp_path / "one" / "run"), keys=("train",))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_2_x_context_parallel_2_on_four_processes_trains_like_one(tmp_path, schedule):
    """Each stage's micro-batches are its context-parallel rank's share of the rows, its forward
    told the tokens' places in the whole sequence (positions and masks follow them): the losses,
    validation's too, are one process's."""
    layout = dict(devices=4, strategy="fsdp", pipeline_parallel=2, context_parallel=2, microbatches=2)
    out = train(recipe(tmp_path / "ppcp", batch=4, spec=TINY_PP, steps=10, pipeline_schedule=schedule, **layout))
    assert "MEMBER: 4/4" in out
    train(recipe(tmp_path / "one", batch=4, spec=TINY_PP, steps=10))
    assert_same_losses(losses(tmp_path / "ppcp" / "run"), losses(tmp_path / "one" / "run"))
