"""``builder plan``: the cheapest layout that fits, sized as ``describe`` sizes it; refusals that
say what would fit; launch lines that a recipe accepts; one-line errors; torch-free and fast."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from yamlformer.builder.analysis.plan import Candidate, Cluster, plan
from yamlformer.builder.cli import main
from yamlformer.builder.spec.loader import load_spec, parse_set_args

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100 = 989.5e12


def _plan_json(capsys, *argv) -> tuple[int, dict]:
    rc = main(["plan", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _sets(line: str) -> list[str]:
    """The ``--set`` values of a torchrun line, or of the command inside an sbatch ``--wrap``."""
    words = shlex.split(line)
    wrap = [w for w in words if w.startswith("--wrap=")]
    if wrap:
        words = shlex.split(wrap[0].removeprefix("--wrap="))
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def test_llama2_70b_on_64_gpus_fits_with_the_json_fields_and_a_describe_line(capsys):
    spec = ROOT / "specs" / "llama2-70b.yaml"
    argv = [str(spec), "--gpus", "64", "--gpu-memory", "80GiB", "--seq-len", "4096", "--global-batch", "1024"]
    # no stages or sequence split (the search's own choice, TP4 PP4 CP2, is the launch test's): the
    # describe line then counts the launch exactly
    argv += ["--pipeline-parallel", "1", "--context-parallel", "1"]
    rc, out = _plan_json(capsys, *argv, "--launchable")
    assert rc == 0 and out["fits"]
    for key in ("tokens_per_s_per_gpu", "mfu", "step_s", "memory_per_gpu_bytes", "layout"):
        assert key in out, key
    chosen, layout = out["plan"], out["layout"]
    assert layout["devices"] == 64 and layout["nodes"] == 8 and layout["pipeline_parallel"] == 1
    assert chosen["micro_batch"] * chosen["accumulate_grad_batches"] * layout["data_parallel_size"] == 1024
    assert out["memory_per_gpu_bytes"] <= 0.9 * 80 * GIB
    assert out["tokens_per_s_per_gpu"] == pytest.approx(1024 * 4096 / out["step_s"] / 64)
    assert 0.1 < out["mfu"] < 0.7 and sum(chosen["breakdown"].values()) == pytest.approx(out["step_s"])
    words = shlex.split(out["launch"]["describe"])
    assert words[:2] == ["builder", "describe"]
    assert main([*words[1:], "--json"]) == 0
    described = json.loads(capsys.readouterr().out)["memory"]
    assert described["layout"]["tensor_parallel"] == layout["tensor_parallel"]
    # describe counts the launch exactly; the model adds backward's transient (the gradients of the
    # largest block it differentiates at once)
    assert described["training_total"] <= out["memory_per_gpu_bytes"] <= 1.15 * described["training_total"]


def test_gpt3_175b_on_8_gpus_is_refused_with_what_would_fit(capsys):
    spec = str(ROOT / "specs" / "gpt3-175b.yaml")
    argv = [spec, "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", "1536", "--seq-len", "2048"]
    rc, out = _plan_json(capsys, *argv, "--launchable")
    assert rc == 1 and not out["fits"] and "launch" not in out
    assert any(r.startswith("the layout needing the least memory") for r in out["reasons"])
    more = [w for w in out["would_fit"] if "GPUs (" in w]
    assert more and more[0].split()[0] in ("16", "32", "64")
    assert main(["plan", *argv, "--launchable"]) == 1
    assert "does not fit" in " ".join(capsys.readouterr().out.split())


def test_the_fastest_fitting_layout_is_chosen():
    small = load_spec(ROOT / "specs" / "gpt2-small.yaml")
    result = plan(small, Cluster(gpus=16, per_node=8, memory=80 * GIB, peak=H100), seq_len=1024, global_batch=512)
    chosen = result.chosen
    assert isinstance(chosen, Candidate) and chosen.memory <= result.cluster.usable
    assert all(chosen.key() <= alt.key() for alt in result.alternatives) and result.fitting >= len(result.alternatives)
    cost = plan(
        small, Cluster(gpus=16, per_node=8, memory=80 * GIB, peak=H100), seq_len=1024, global_batch=512, rank_by="cost"
    )
    assert cost.chosen.layout == chosen.layout  # one cluster: GPU-hours rank as time does
    # pinned: a published layout is taken as given
    pinned = plan(
        small,
        Cluster(gpus=16, per_node=8, memory=80 * GIB, peak=H100),
        seq_len=1024,
        global_batch=512,
        tensor_parallel=1,
        pipeline_parallel=2,
        micro_batch=4,
        checkpointing="selective",
        schedule="interleaved-1f1b",
    )
    lay = pinned.chosen.layout
    assert (lay.tensor_parallel, lay.pipeline_parallel, pinned.chosen.micro_batch) == (1, 2, 4)
    assert (pinned.chosen.recompute, pinned.chosen.run.schedule) == ("selective", "interleaved-1f1b")
    assert pinned.chosen.step_seconds > chosen.step_seconds


def test_llama3_405b_on_1024_h100s_prefers_tensor_or_pipeline_parallelism_and_says_why(capsys, monkeypatch):
    argv = ["llama3-405b", "--gpus", "1024", "--seq-len", "8192", "--global-batch", "1024", "--checkpointing", "full"]
    rc, out = _plan_json(capsys, *argv)
    assert rc == 0 and out["fits"]
    layout = out["layout"]
    assert layout["tensor_parallel"] > 1 or layout["pipeline_parallel"] > 1
    flat = out["fsdp_only"]  # FSDP over all 1,024 GPUs: a 405B layer gathered whole does not fit
    assert flat["layout"]["tensor_parallel"] == flat["layout"]["pipeline_parallel"] == 1
    assert flat["memory_per_gpu_bytes"] > out["cluster"]["usable_memory"] or flat["step_s"] > out["step_s"]
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", *argv]) == 0
    text = capsys.readouterr().out
    assert "(FSDP only)" in text and "where the time goes" in text and "exposed tp" in text


def test_llama3_405b_on_8192_h100s_with_a_16m_token_batch_uses_tensor_or_pipeline_parallelism(capsys):
    """Llama 3's own scale: 2,048 sequences of 8,192 tokens cannot spread over 8,192 FSDP ranks, and
    without tensor or pipeline parallelism (context parallel 4 x FSDP) every rank gathers the whole
    model over the network each step: the breakdown shows it waiting on FSDP."""
    argv = ["llama3-405b", "--gpus", "8192", "--seq-len", "8192", "--global-batch-tokens", "16Mi"]
    rc, out = _plan_json(capsys, *argv)
    assert rc == 0 and out["settings"]["global_batch"] == 2048
    assert out["layout"]["tensor_parallel"] > 1 or out["layout"]["pipeline_parallel"] > 1
    assert out["fsdp_only"] is None and any("does not divide over 8192" in r for r in out["reasons"])
    flat = out["no_tensor_or_pipeline"]
    assert flat["step_s"] > 2 * out["step_s"]
    assert flat["breakdown"]["exposed_fsdp"] > flat["breakdown"]["gemm"] + flat["breakdown"]["attention"]


def test_deepseek_v3_on_2048_h800s_uses_expert_parallelism(capsys):
    argv = ["deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--seq-len", "4096", "--global-batch", "4096"]
    rc, out = _plan_json(
        capsys, *argv, "--pipeline-parallel", "16", "--checkpointing", "full", "--context-parallel", "1"
    )
    assert rc == 0 and out["fits"] and out["layout"]["expert_parallel"] > 1
    assert out["memory_per_gpu_bytes"] <= out["cluster"]["usable_memory"]
    assert out["plan"]["communication"]["ep"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        [
            "specs/llama2-70b.yaml",
            "--gpus",
            "64",
            "--gpu-memory",
            "80GiB",
            "--seq-len",
            "4096",
            "--global-batch",
            "1024",
            "--pipeline-parallel",  # pipeline stages launch as test_plan_launch checks
            "1",
        ],
        [
            "specs/llama2-7b.yaml",
            "--gpus",
            "16",
            "--gpu-memory",
            "40GB",
            "--global-batch",
            "256",
            "--gpu",
            "a100",
            "--set",
            "decoder.n_layers=16",
            "--pipeline-parallel",  # pipeline stages launch as test_plan_launch checks
            "1",
        ],
        [
            "specs/mixtral-8x7b.yaml",
            "--gpus",
            "32",
            "--gpu-memory",
            "141GB",
            "--seq-len",
            "4096",
            "--global-batch",
            "512",
            "--gpu",
            "h200",
            "--tensor-parallel",
            "2",
            "--pipeline-parallel",  # pipeline stages launch as test_plan_launch checks
            "1",
        ],
        [
            "specs/gpt2-small.yaml",
            "--gpus",
            "4",
            "--gpu-memory",
            "24GiB",
            "--global-batch",
            "64",
            "--recipe",
            "recipes/shakespeare-char.yaml",
        ],
        [
            "specs/t5-small.yaml",
            "--gpus",
            "4",
            "--gpu-memory",
            "24GiB",
            "--global-batch",
            "256",
            "--seq-len",
            "256",
            "--recipe",
            "recipes/translate-multi30k.yaml",
        ],
    ],
)
def test_every_launch_line_is_a_valid_recipe_override_set(argv, capsys, monkeypatch):
    from yamlformer.recipes.recipe.sections import TrainerSection
    from yamlformer.recipes.tasks import load_recipe

    if "tensor_parallel" not in TrainerSection.model_fields:
        pytest.skip("recipes lack trainer.tensor_parallel / trainer.data_parallel (issue 11's FSDP2 recipes)")
    monkeypatch.chdir(ROOT)
    rc, out = _plan_json(capsys, *argv, "--launchable")
    assert rc == 0, out
    launch = out["launch"]
    recipe = argv[argv.index("--recipe") + 1] if "--recipe" in argv else "recipes/lm-stdlib.yaml"
    for line in (launch["torchrun"], launch["slurm"]):
        sets = _sets(line)
        assert sets == launch["set"]
        loaded = load_recipe(recipe, parse_set_args(sets)).recipe
        trainer, data = loaded.trainer, loaded.data
        layout = out["plan"]["layout"]
        assert (trainer.strategy, trainer.tensor_parallel, trainer.data_parallel) == (
            "fsdp",
            layout["tensor_parallel"],
            layout["data_parallel"],
        )
        assert (trainer.devices, trainer.num_nodes) == (layout["per_node"], layout["nodes"])
        seq, micro = out["settings"]["seq_len"], out["plan"]["micro_batch"]
        if loaded.task == "translation":  # token budgets: micro-batches of at most micro x seq tokens
            assert (data.max_len, data.max_tokens) == (seq, micro * seq)
        else:
            assert (data.batch_size, data.seq_len) == (micro, seq)
        assert trainer.accumulate_grad_batches == out["plan"]["accumulate_grad_batches"]
        assert trainer.activation_checkpointing == out["plan"]["activation_checkpointing"]
        spec_path = (ROOT / recipe).parent / loaded.model.spec
        assert spec_path.resolve() == (ROOT / argv[0]).resolve()
    if "--set" in argv:
        assert loaded.model.overrides == {"decoder.n_layers": 16}
    assert launch["torchrun"].startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --")
    assert launch["slurm"].startswith(f"sbatch --nodes={out['plan']['layout']['nodes']} ")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--gpus", "12", "--gpus-per-node", "8"], "error: --gpus 12 is not a multiple of --gpus-per-node 8"),
        (["--gpus", "16", "--nodes", "3"], "error: --nodes 3: --gpus 16 is not a multiple of it"),
        (
            ["--gpus", "16", "--nodes", "4", "--gpus-per-node", "8"],
            "error: --nodes 4: 4 nodes x 8 GPUs per node is not",
        ),
        (["--gpus", "16", "--tensor-parallel", "3"], "error: --tensor-parallel 3: must divide the 8 devices of a node"),
        (
            ["--gpus", "12", "--gpus-per-node", "6", "--tensor-parallel", "3"],
            # the planner pads the vocabulary as Megatron-LM does; the heads it cannot split
            "error: --tensor-parallel 3: decoder.attention.n_heads: 32 is not a multiple of the tensor-parallel degree",
        ),
        (["--gpus", "8", "--gpu-memory", "80XB"], "error: --gpu-memory '80XB': not a size such as 80GiB or 141GB"),
        (["--gpus", "8", "--gpu-memory", "lots"], "error: --gpu-memory 'lots': not a size"),
        (["--gpus", "8", "--gpu", "v100"], "error: --gpu 'v100': unknown; one of a100-40gb, a100-80gb, h100"),
        (["--gpus", "64", "--pipeline-parallel", "64"], "error: --pipeline-parallel 64: decoder.n_layers (32): more"),
        (["--gpus", "16", "--expert-parallel", "2"], "error: --expert-parallel 2: llama2-7b has no experts to split"),
        (
            ["--gpus", "8", "--micro-batch", "3", "--global-batch", "16", "--tensor-parallel", "1"],
            "error: --micro-batch 3: does not divide the 2 sequences of one data-parallel rank",
        ),
        (
            ["--gpus", "16", "--pipeline-parallel", "2", "--schedule", "interleaved-1f1b", "--micro-batch", "2"]
            + ["--global-batch", "16", "--tensor-parallel", "1", "--context-parallel", "1"],
            "error: --micro-batch 2: leaves 1 micro-batches, which interleaved 1F1B needs a multiple of the 2",
        ),
        (
            ["--gpus", "16", "--context-parallel", "2", "--seq-len", "1026"],
            "error: --context-parallel 2: seq_len 1026 does not split into 2 x 2 equal chunks",
        ),
        (["--gpus", "8", "--seq-len", "8192"], "error: --seq-len 8192: more than llama2-7b's max_seq_len (4096)"),
        (
            ["--gpus", "16", "--data-parallel", "hybrid", "--nodes", "1", "--gpus-per-node", "16"],
            "error: --data-parallel hybrid: shards inside a node",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_argument(argv, expected, capsys):
    base = {"--gpu-memory": "80GiB", "--global-batch": "64"}
    for option, value in base.items():
        if option not in argv:
            argv = [*argv, option, value]
    assert main(["plan", str(ROOT / "specs" / "llama2-7b.yaml"), *argv]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(expected), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err and captured.out == ""


def test_an_option_out_of_its_own_range_is_a_one_line_usage_error(capsys):
    argv = ["plan", "llama2-7b", "--gpus", "8", "--global-batch", "64", "--peak-tflops", "0"]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("builder plan: error: argument --peak-tflops:") and err.count("\n") == 1


def test_planning_a_big_spec_is_quick_and_torch_free():
    code = (
        "import sys, time; from yamlformer.builder.spec.loader import load_spec; "
        "from yamlformer.builder.analysis.plan import Cluster, plan; "
        "spec = load_spec('specs/gpt3-175b.yaml'); t = time.process_time(); "
        "f = plan(spec, Cluster(gpus=64, per_node=8, memory=80 * 2**30, peak=989.5e12), seq_len=2048, "
        "global_batch=1536, launchable=True); "
        "print(f.fits, time.process_time() - t, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    fits, fitted, torch_loaded = done.stdout.split()
    assert (fits, torch_loaded) == ("True", "False")
    assert float(fitted) < 10.0


@pytest.mark.parametrize(
    "spec, recipe",
    [
        ("llama2-70b", None),  # zoo names, the default recipe
        ("llama2-7b", "lm-stdlib"),
        (str(ROOT / "specs" / "gpt2-small.yaml"), str(ROOT / "recipes" / "shakespeare-char.yaml")),
    ],
)
def test_a_printed_launch_line_runs_as_printed_from_another_folder(spec, recipe, tmp_path, capsys, monkeypatch):
    """Each line's ``builder train`` part, given ``--dry-run``, resolves from a folder that is
    neither the repository nor the recipe's: zoo names stay zoo names, files are absolute, and the
    line sets its own steps (20 tokens per parameter by default), output folder and no time limit."""
    argv = [spec, "--gpus", "16", "--gpu-memory", "80GiB", "--global-batch", "64", "--seq-len", "1024"]
    monkeypatch.chdir(tmp_path)
    argv.append("--launchable")
    rc, out = _plan_json(capsys, *argv, *(["--recipe", recipe] if recipe else []))
    assert rc == 0, out
    launch = out["launch"]
    tokens_per_step = out["settings"]["tokens_per_step"]
    for line in (launch["torchrun"], launch["slurm"]):
        words = shlex.split(line)
        wrap = [w for w in words if w.startswith("--wrap=")]
        words = shlex.split(wrap[0].removeprefix("--wrap=")) if wrap else words
        train = words[words.index("train") :]
        assert train[1] == (recipe or "lm-stdlib")
        sets = parse_set_args(_sets(line))
        assert sets["model.spec"] == spec and sets["trainer.max_time"] is None
        assert (
            sets["trainer.max_steps"] * tokens_per_step
            >= 20 * out["params"]
            > (sets["trainer.max_steps"] - 1) * tokens_per_step
        )
        assert sets["trainer.output_dir"].startswith("runs/")
        assert main([*train, "--dry-run"]) == 0, capsys.readouterr().err
        shown = capsys.readouterr().out
        assert f"{sets['trainer.max_steps']:,} steps" in shown and "resumes from" not in shown
    rc, out = _plan_json(capsys, *argv, "--tokens", "2T")
    assert parse_set_args(_sets(out["launch"]["torchrun"]))["trainer.max_steps"] == -(-2 * 10**12 // tokens_per_step)


def test_a_recipe_the_plan_cannot_find_is_one_line(capsys):
    assert (
        main(
            ["plan", "llama2-7b", "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", "8", "--recipe", "lm-stdlb"]
        )
        == 1
    )
    assert capsys.readouterr().err.strip() == (
        "error: --recipe lm-stdlb: no such file, nor a zoo name; did you mean "
        "'lm-stdlib'? (`builder list` shows the zoo)"
    )
