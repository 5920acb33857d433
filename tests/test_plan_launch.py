"""``builder plan --launchable`` in every dimension the recipes' runtime runs: a mixture of experts
gets expert parallelism, a long sequence context parallelism, a deep model pipeline stages, each
launch line carrying the trainer fields; what the runtime refuses (``yamlformer.builder.analysis.runtime``,
the one table of its rules) is skipped by the search, refused when pinned, and said in one line
of a plan that was not searched for launching."""

from __future__ import annotations

import json
import shlex

import pytest

from yamlformer.builder.analysis import runtime
from yamlformer.builder.cli import main
from yamlformer.builder.spec.loader import parse_set_args


def _plan(capsys, *argv) -> tuple[int, dict]:
    rc = main(["plan", *argv, "--launchable", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _sets(line: str) -> dict:
    words = shlex.split(line)
    return parse_set_args([words[i + 1] for i, w in enumerate(words) if w == "--set"])


def test_a_mixture_of_experts_launches_expert_parallel(capsys):
    argv = ["deepseek-v2-lite", "--gpus", "16", "--seq-len", "4096", "--global-batch", "256"]
    rc, out = _plan(capsys, *argv, "--pipeline-parallel", "1", "--context-parallel", "1")  # EP alone
    layout = out["layout"]
    assert rc == 0 and layout["expert_parallel"] > 1 and layout["data_parallel"] != "replicate"
    sets = _sets(out["launch"]["torchrun"])
    assert sets["trainer.expert_parallel"] == layout["expert_parallel"]
    assert "trainer.context_parallel" not in sets and "trainer.pipeline_parallel" not in sets
    assert f"--expert-parallel {layout['expert_parallel']}" in out["launch"]["describe"]


def test_a_long_sequence_launches_context_parallel(capsys):
    rc, out = _plan(capsys, "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--global-batch", "8")
    layout = out["layout"]
    assert rc == 0 and layout["context_parallel"] > 1 and out["plan"]["run"]["context_gather"]
    sets = _sets(out["launch"]["torchrun"])
    assert sets["trainer.context_parallel"] == layout["context_parallel"]
    assert sets["data.seq_len"] == 131072 and 131072 % (2 * layout["context_parallel"]) == 0


def test_pipeline_stages_launch_with_their_schedule_and_micro_batches(capsys):
    argv = ["specs/llama2-70b.yaml", "--gpus", "64", "--gpu-memory", "80GiB", "--seq-len", "4096"]
    rc, out = _plan(capsys, *argv, "--global-batch", "1024", "--pipeline-parallel", "4")
    plan, sets = out["plan"], _sets(out["launch"]["torchrun"])
    assert rc == 0 and sets["trainer.pipeline_parallel"] == 4
    assert sets["trainer.pipeline_schedule"] in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
    micro = plan["accumulate_grad_batches"]  # the pipeline's micro-batches
    assert sets["trainer.microbatches"] == micro and sets["trainer.accumulate_grad_batches"] == 1
    assert sets["data.batch_size"] == plan["micro_batch"] * micro  # the schedule cuts it
    from yamlformer.recipes.recipe.sections import TrainerSection
    from yamlformer.recipes.tasks import load_recipe

    if "pipeline_parallel" in TrainerSection.model_fields:  # the runtime with pipeline stages accepts it
        load_recipe("recipes/lm-stdlib.yaml", {k: v for k, v in sets.items() if k.startswith(("trainer.", "data."))})


def test_the_search_never_proposes_what_the_runtime_refuses(capsys):
    rc, out = _plan(capsys, "deepseek-v2-lite", "--gpus", "16", "--seq-len", "8192", "--global-batch", "64")
    assert rc == 0 and not runtime.problems(runtime.Settings(**_fields(out)))
    assert any(r.startswith("not launchable (") for r in out["reasons"])


def _fields(out) -> dict:
    sets = _sets(out["launch"]["torchrun"])
    names = set(runtime.Settings.__dataclass_fields__)
    return {k.removeprefix("trainer."): v for k, v in sets.items() if k.removeprefix("trainer.") in names}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--expert-parallel", "2", "--context-parallel", "4"],
            "error: --expert-parallel 2: not launchable: expert_parallel 2 with context_parallel 4: the expert group",
        ),
        (["--checkpointing", "selective"], "error: --checkpointing selective: not launchable: recomputation selective"),
    ],
)
def test_a_pinned_setting_the_runtime_refuses_is_one_line(argv, expected, capsys):
    spec = ["deepseek-v2-lite", "--gpus", "16", "--seq-len", "4096", "--global-batch", "256"]
    assert main(["plan", *spec, *argv, "--launchable"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_a_plan_leads_with_the_best_layout_that_launches_and_shows_the_faster_one_beside_it(capsys, monkeypatch):
    """The fastest layout here is context parallel sized as ring attention, which the recipes do not
    run: the plan leads with the best one they run, with its lines, and names the faster one and why
    (it printed no lines and left the user to find --launchable)."""
    monkeypatch.setenv("COLUMNS", "200")  # the table's rows on one line each
    argv = ["llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "64"]
    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    faster = out["faster_not_launchable"]
    assert out["launch"]["torchrun"] and out["not_launchable"] is None
    assert not runtime.problems(runtime.Settings(**_fields(out)))
    why = faster["not_launchable"]
    assert why.startswith("not launchable: trainer.context_parallel: context_parallel ") and "ring attention" in why
    assert faster["step_seconds"] < out["step_s"]
    assert main(["plan", *argv]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.index("faster, not launchable by the recipes:") < shown.index("torchrun ")
    assert why in shown and "(faster, not launchable)" in shown
    rc, only = _plan(capsys, *argv)  # --launchable: only what launches, nothing beside it
    assert rc == 0 and only["faster_not_launchable"] is None and only["layout"] == out["layout"]


def test_a_plan_pinned_to_what_the_recipes_do_not_run_says_why_it_has_no_lines(capsys):
    argv = ["llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "64", "--checkpointing", "selective"]
    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["launch"] is None and out["faster_not_launchable"] is None
    why = "not launchable: trainer.activation_checkpointing: recomputation selective"
    assert out["not_launchable"].startswith(why)
    assert main(["plan", *argv]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"no launch lines, {why}" in shown


def test_a_zero_bubble_plan_launches_the_v_schedule_where_the_layers_cut_twice_per_rank(capsys):
    """The runtime's zero-bubble schedule (zbv) holds two stages per rank: a plan pinned to it
    launches it where the layers make 2 x pipeline_parallel stages, and refuses it where not."""
    argv = ["specs/llama2-70b.yaml", "--gpus", "64", "--gpu", "h200", "--global-batch", "1024"]
    argv += ["--schedule", "zero-bubble", "--checkpointing", "full", "--tensor-parallel", "1"]
    rc, out = _plan(capsys, *argv, "--pipeline-parallel", "4")
    sets = _sets(out["launch"]["torchrun"])
    assert rc == 0 and sets["trainer.pipeline_schedule"] == "zbv" and sets["trainer.pipeline_parallel"] == 4
    assert not runtime.problems(runtime.Settings(**_fields(out)))
    assert main(["plan", *argv, "--pipeline-parallel", "64", "--launchable"]) == 1  # 128 stages, 80 layers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zero-bubble stages per rank is more chunks than the 80 layers" in err, err


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"expert_parallel": 2, "context_parallel": 4, "devices": 8}, "expert_parallel"),
        ({"expert_parallel": 4, "context_parallel": 2, "devices": 8}, None),
        ({"expert_parallel": 2, "data_parallel": "replicate", "devices": 4}, "expert_parallel"),
        ({"pipeline_parallel": 2, "context_parallel": 2, "devices": 4}, None),
        ({"pipeline_parallel": 2, "expert_parallel": 2, "devices": 4}, None),
        ({"pipeline_parallel": 2, "pipeline_schedule": "dualpipev", "devices": 4}, "microbatches"),
        ({"pipeline_parallel": 2, "pipeline_schedule": "dualpipev", "microbatches": 4, "devices": 4}, None),
        ({"pipeline_parallel": 2, "pipeline_schedule": "zbv", "devices": 4}, None),
        ({"pipeline_parallel": 2, "accumulate_grad_batches": 2, "devices": 4}, "accumulate_grad_batches"),
        ({"pipeline_parallel": 3, "devices": 4}, "pipeline_parallel"),
        ({"microbatches": 2}, "microbatches"),
        ({"tensor_parallel": 2, "context_parallel": 4, "devices": 4}, "context_parallel"),
        ({"context_parallel": 2, "strategy": "ddp"}, "context_parallel"),
        ({"data_parallel": "hybrid", "devices": 4}, "data_parallel"),
        ({"tensor_parallel": 2, "context_parallel": 2, "devices": 4}, None),
        ({"pipeline_parallel": 2, "tensor_parallel": 2, "microbatches": 4, "devices": 4}, None),
    ],
)
def test_the_runtime_table_and_the_trainer_section_refuse_alike(settings, field):
    """Each rule names its trainer field; the recipes' trainer section (which is to read this
    table) refuses the same settings, where it has the fields."""
    from yamlformer.recipes.recipe.sections import TrainerSection

    found = runtime.problems(runtime.Settings(**{"strategy": "fsdp", **settings}))
    assert (found[0][0] if found else None) == field, found
    if not set(settings) <= set(TrainerSection.model_fields):
        return  # a runtime without these fields yet
    fields = {"strategy": "fsdp", "accelerator": "cpu", "precision": "bf16-mixed", **settings}
    if field is None:
        TrainerSection(**fields)
    else:
        with pytest.raises(ValueError, match=field):
            TrainerSection(**fields)


def test_a_latent_attention_is_not_offered_context_parallelism_to_launch(capsys):
    """DeepSeek's latent attention has no context-parallel path in the blocks (its config's
    ``context_parallel_problems``): a launchable plan of a long sequence finds another layout,
    says why, and a pinned degree is one line naming the field."""
    argv = ["deepseek-v2-lite", "--gpus", "16", "--seq-len", "32768", "--global-batch", "16"]
    rc, out = _plan(capsys, *argv)
    assert rc == 0 and out["layout"]["context_parallel"] == 1
    assert any("context_parallel" in r and "mla attention" in r for r in out["reasons"])
    assert main(["plan", *argv, "--launchable", "--context-parallel", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--context-parallel" in err and "decoder.attention.type" in err, err
    rc, out = _plan(capsys, "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--global-batch", "8")
    assert rc == 0 and out["layout"]["context_parallel"] > 1  # multi_head attention splits


def test_a_pipeline_the_runtime_cannot_cut_is_one_line_naming_the_spec_field(capsys):
    """DeepSeek-V3's multi-token-prediction head adds losses read from the embedding, which the
    last stage does not hold (its config's ``pipeline_parallel_problems``, as the runtime's
    ``check_pipeline`` refuses it): a launchable plan pinned to stages says so in one line."""
    argv = ["deepseek-v3", "--gpus", "64", "--global-batch", "512", "--seq-len", "4096", "--launchable"]
    assert main(["plan", *argv, "--pipeline-parallel", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --pipeline-parallel 2: not launchable: head.type: the mtp head's own losses")
    assert err.count("\n") == 1, err


def test_gpt3_with_its_odd_tied_vocabulary_is_offered_tensor_and_pipeline_layouts(capsys):
    """GPT-3 175B's 50,257-token vocabulary divides by no tensor-parallel degree and its head is tied
    to the embedding: the planner pads the vocabulary as Megatron-LM does (128 x TP) and keeps the
    tied table on the first and last stages, so it offers what a Megatron user would run, with
    launch lines that set the padding (and a schedule placing those stages on different ranks)."""
    from yamlformer.recipes.recipe.sections import TrainerSection
    from yamlformer.recipes.tasks import load_recipe

    rc, out = _plan(capsys, "gpt3-175b", "--gpus", "96", "--seq-len", "2048", "--global-batch", "1152")
    layout, plan = out["layout"], out["plan"]
    assert rc == 0 and layout["tensor_parallel"] > 1 and layout["pipeline_parallel"] > 1
    multiple = 128 * layout["tensor_parallel"]
    assert plan["spec_overrides"] == [f"pad_vocab_to_multiple_of={multiple}"]
    assert "the vocabulary padded to" in plan["summary"] and out["fsdp_only"]["mfu"] < out["mfu"]
    sets = _sets(out["launch"]["torchrun"])
    assert sets["model.overrides.pad_vocab_to_multiple_of"] == multiple
    assert sets["trainer.pipeline_schedule"] in ("gpipe", "1f1b", "interleaved_1f1b")  # not a V: the head is tied
    assert f"--set pad_vocab_to_multiple_of={multiple}" in out["launch"]["describe"]
    if "pipeline_parallel" in TrainerSection.model_fields:
        runtime = {k: v for k, v in sets.items() if k.startswith(("trainer.", "data."))}
        load_recipe("recipes/lm-stdlib.yaml", runtime)  # the runtime takes the layout
