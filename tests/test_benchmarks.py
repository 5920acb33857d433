"""The yardstick of benchmarks/shakespeare_char.py computes what the recipe computes: same model
function on the same weights, same schedule, and its own init draws from the same distribution."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "benchmarks"))  # the benchmark scripts, imported as modules


def _recipe_model(vocab_size: int = 65, seed: int = 3):
    from yamlformer.builder import build_model
    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe

    recipe_file = REPO / "recipes" / "shakespeare-char.yaml"
    located = load_recipe(recipe_file)
    recipe, spec = located.recipe, model_spec(located, vocab_size)
    torch.manual_seed(seed)
    return recipe, spec, build_model(spec)


def test_yardstick_on_the_recipes_weights_is_the_same_function():
    from shakespeare_char import check_nanogpt_shaped, nanogpt_state
    from yardstick import GPT, GPTConfig

    recipe, spec, ours = _recipe_model()
    check_nanogpt_shaped(spec, recipe)
    theirs = GPT(
        GPTConfig(
            vocab_size=65,
            block_size=spec.max_seq_len,
            n_layer=spec.decoder.n_layers,
            n_head=spec.decoder.attention.n_heads,
            n_embd=spec.d_model,
        )
    )
    theirs.load_state_dict(nanogpt_state(ours.state_dict(), spec.decoder.n_layers))
    x = torch.randint(0, 65, (3, 64))
    y = torch.randint(0, 65, (3, 64))
    logits, loss = theirs(x, y)
    torch.testing.assert_close(logits, ours(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, F.cross_entropy(ours(x).flatten(0, 1), y.flatten()), rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in theirs.parameters()) == ours.n_params()  # tied head counted once in both


def test_yardstick_schedule_is_the_recipes():
    from yardstick import LoopConfig, get_lr

    from yamlformer.recipes.optim.schedule import lr_multiplier

    recipe, _, _ = _recipe_model()
    s, opt = recipe.schedule, recipe.optimizer
    loop = LoopConfig(
        max_iters=2000, learning_rate=opt.lr, min_lr=s.min_lr, warmup_iters=s.warmup_steps, lr_decay_iters=s.decay_steps
    )
    for step in (0, 50, 99, 100, 101, 1000, 1999, 2000, 2500):
        assert get_lr(step, loop) == pytest.approx(opt.lr * lr_multiplier(step, s, opt.lr, 2000), rel=1e-12)


def test_yardstick_init_has_the_recipes_distribution():
    """nanoGPT's init (normal 0.02, residual projections 0.02 / sqrt(2 n_layer), LayerNorm 1) is
    the recipe's: tensor by tensor, the standard deviations agree."""
    from shakespeare_char import nanogpt_state
    from yardstick import GPT, GPTConfig

    _, spec, ours = _recipe_model(vocab_size=512)
    torch.manual_seed(0)
    theirs = GPT(
        GPTConfig(
            vocab_size=512,
            block_size=spec.max_seq_len,
            n_layer=spec.decoder.n_layers,
            n_head=spec.decoder.attention.n_heads,
            n_embd=spec.d_model,
        )
    ).state_dict()
    mapped = nanogpt_state(ours.state_dict(), spec.decoder.n_layers)
    assert set(mapped) == set(theirs)
    for name, tensor in theirs.items():
        expected = 0.02 / math.sqrt(2 * spec.decoder.n_layers) if name.endswith("c_proj.weight") else 0.02
        if "ln_" in name:
            assert torch.equal(tensor, mapped[name]) and torch.all(tensor == 1)
        else:
            assert tensor.std().item() == pytest.approx(expected, rel=0.1), name
            assert mapped[name].std().item() == pytest.approx(expected, rel=0.1), name


def test_yardstick_loop_learns_and_times_its_intervals():
    from yardstick import GPT, GPTConfig, LoopConfig, train

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    data = torch.arange(16).repeat(40)  # a cycle: learnable

    def batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            starts = torch.randint(0, len(data) - 9, (8,), generator=generator)
            block = torch.stack([data[s : s + 9] for s in starts])
            yield block[:, :-1].contiguous(), block[:, 1:].contiguous()  # as nanoGPT's get_batch

    val = [next(batches())]
    result = train(
        model,
        batches(),
        lambda: val,
        LoopConfig(
            max_iters=60, learning_rate=1e-2, warmup_iters=5, lr_decay_iters=60, eval_interval=30, log_interval=10
        ),
    )
    assert [e[0] for e in result["val"]] == [30, 60] and result["val"][1][1] < 1.0
    assert len(result["intervals"]) == 6 and all(n == 10 and s > 0 for n, s in result["intervals"])
    assert result["val"][1][2] >= sum(s for _, s in result["intervals"])


def test_generate_benchmark_decodes_the_same_tokens_as_transformers(tmp_path, capsys, monkeypatch):
    """benchmarks/generate.py on one short run: both sides decode from the same imported weights
    and the rows it reports hold rates, ratios (compiled and eager), compile seconds and identical
    tokens. The compiled step is traced by Dynamo only here (Inductor's code generation costs tens
    of seconds; tests/test_static_decode.py runs it under ``-m slow``)."""
    pytest.importorskip("transformers")
    from generate import bench, make_models

    from yamlformer.blocks import generation

    torch._dynamo.reset()
    monkeypatch.setattr(
        generation,
        "_COMPILED_STEP",
        torch.compile(generation._compiled_decode_step, backend="eager", fullgraph=True, dynamic=False),
    )
    rows = bench("gpt2", [1, 2], prompt_len=4, new_tokens=6, repeats=1)
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["identical"], row.get("first_difference")
        assert row["ours_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tokens_per_s"] / row["transformers_tokens_per_s"])
        assert row["eager_ratio"] == pytest.approx(row["ours_eager_tokens_per_s"] / row["transformers_tokens_per_s"])
        assert row["compile_seconds"] > 0  # each batch's warm-up compiled its step
    assert "gpt2   batch  2" in capsys.readouterr().out
    ours, theirs = make_models("llama", tmp_path)  # the other family: same function on the same weights
    ids = torch.randint(0, 8192, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_kernel_efficiency_benchmark_runs_its_rows_on_the_cpu(capsys):
    """benchmarks/perf_kernels.py --cpu: every GEMM row (bf16 and float8 through torch's
    ``_scaled_mm``) and every attention row measured at 1/64 of the published shapes, the tables
    and the JSON line; without CUDA and without --cpu it refuses (exit 2)."""
    import json

    import perf_kernels

    assert perf_kernels.main(["--cpu", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert [(row["model"], row["dtype"]) for row in result["gemms"]] == [
        (model, dtype) for model in perf_kernels.LAYERS for dtype in ("bf16", "fp8")
    ]
    assert len(result["attention"]) == len(perf_kernels.ATTENTION)
    rates = [row["tflops"] for row in result["gemms"]] + [row["forward_tflops"] for row in result["attention"]]
    assert all(rate > 0 and math.isfinite(rate) for rate in rates)
    assert "| llama3-405b, TP 8 (table 5) | fp8 |" in out
    if not torch.cuda.is_available():
        assert perf_kernels.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    # the GPU branch's peaks, whatever this machine has: a known device with float8, one without, an unknown one
    assert perf_kernels.device_peaks("NVIDIA H200")["fp8"] == 1979e12
    assert "fp8" not in perf_kernels.device_peaks("NVIDIA A100-SXM4-80GB")
    assert perf_kernels.device_peaks("Some Future GPU") == {}


def test_the_kernel_timer_reads_cuda_events_in_seconds_whatever_this_machine_has(monkeypatch):
    """perf_kernels.timed's CUDA branch, forced on any machine: two warm-up calls untimed, then the
    median of the events' elapsed milliseconds, as seconds (the CPU branch is the test above)."""
    import types

    import perf_kernels

    elapsed = iter([3.0, 1.0, 2.0])  # milliseconds, one per timed call

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    seconds = perf_kernels.timed(lambda: calls.append(1), types.SimpleNamespace(type="cuda"), repeats=3)
    assert seconds == pytest.approx(2e-3)
    assert len(calls) == 2 + 3


def test_the_kernel_benchmark_writes_this_gpu_s_calibration_table(tmp_path, monkeypatch, capsys):
    """benchmarks/perf_kernels.py --write: the whole measurement (yamlformer.builder.analysis.calibration
    .measure, here a stand-in returning the shipped H200 table) written as <gpu>.yaml with the run
    that measured it, read back by the planner's loader; --out without --write is refused."""
    import json

    import perf_kernels

    from yamlformer.builder.analysis.calibration import SHIPPED
    from yamlformer.builder.analysis.calibration.table import load_table

    shipped = load_table(SHIPPED / "h200.yaml")
    calls = []
    monkeypatch.setattr(
        perf_kernels, "measure_table", lambda cpu, repeats, log: calls.append((cpu, repeats)) or shipped
    )
    assert perf_kernels.main(["--cpu", "--repeats", "2", "--write", "--out", str(tmp_path)]) == 0
    assert calls == [(True, 2)]
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert written["path"] == str(tmp_path / "h200.yaml") and written["measured"]["date"] == "2026-12-04"
    text = (tmp_path / "h200.yaml").read_text()
    assert text.startswith("# h200's kernel rates, measured by `python benchmarks/perf_kernels.py --write`")
    assert load_table(tmp_path / "h200.yaml") == shipped
    with pytest.raises(SystemExit):
        perf_kernels.main(["--cpu", "--out", str(tmp_path)])
    assert "--out goes with --write" in capsys.readouterr().err


def test_every_benchmark_script_starts_under_python_dash_p():
    """A script whose folder is not on sys.path (``python -P``, or PYTHONSAFEPATH=1, which the
    README advises and the suite sets) still finds its sibling modules: gpu_check's attention
    section died on ``No module named 'attention_sweep'``. Each script's ``--help``, in one child
    process that puts no script's folder on its path (runpy.run_path does not)."""
    import subprocess

    scripts = sorted(str(p) for p in (REPO / "benchmarks").glob("*.py"))
    code = (
        "import os, runpy, sys\n"
        "failed, path, scripts = [], list(sys.path), sys.argv[1:]\n"
        "folder = os.path.dirname(scripts[0])\n"
        "for script in scripts:\n"
        "    sys.path[:] = path  # what an earlier script added, and the modules it imported from here, forgotten\n"
        "    for name in [n for n, m in sys.modules.items() if str(getattr(m, '__file__', '')).startswith(folder)]:\n"
        "        del sys.modules[name]\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as stop:\n"
        "        if stop.code not in (0, None): failed.append(f'{script}: exit {stop.code}')\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{script}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code, *scripts], cwd="/", capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("data", ["instructions", "random"])
def test_the_peft_side_by_side_trains_both_sides_to_the_same_losses(tmp_path, capsys, data):
    """benchmarks/lora_vs_peft.py --quick: our LoRA and DoRA and peft's on transformers, from the same
    start on the same data, lose the same per step (each side in its own process): instruction
    records packed on our side and padded on peft's, and whole windows of random tokens."""
    import json

    import lora_vs_peft

    out = tmp_path / "result.json"
    kinds = ("lora", "dora") if data == "instructions" else ("lora",)
    assert lora_vs_peft.main(["--quick", "--data", data, "--kinds", ",".join(kinds), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for kind in kinds:
        row = result["kinds"][kind]
        assert row["max_loss_difference"] <= 1e-4 and row["trainable"] > 0, row
        assert row["tokens_per_s_ratio"] > 0 and row["peak_ratio"] > 0, row
    assert "per-step losses differ by at most" in capsys.readouterr().out


@pytest.mark.slow
def test_the_trl_side_by_side_trains_every_side_to_trls_losses_and_rewards(tmp_path, capsys):
    """benchmarks/preference_vs_trl.py --quick: DPO with LoRA as task preference trains it (pairs
    packed), our loss on TRL's own padded batch (the equal-work control) and TRL's DPOTrainer, from
    the same start on the same pairs, lose the same and reward the same per step."""
    import json

    import preference_vs_trl

    out = tmp_path / "result.json"
    assert preference_vs_trl.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for side in ("ours", "control"):
        row = result["sides"][side]
        assert row["max_losses_difference"] <= 1e-4, row
        for key in ("rewards_chosen", "rewards_rejected"):
            assert row[f"max_{key}_difference"] <= row["reward_tolerance"], row
        assert row["tokens_per_s_ratio"] > 0 and row["peak_ratio"] > 0 and row["trainable"] > 0, row
    assert "differ from TRL's by at most" in capsys.readouterr().out


def test_the_startup_benchmark_runs_a_version_laid_out_as_installed(tmp_path):
    """benchmarks/startup.py's plumbing: the working tree as an installed yamlformer with its own
    entry points, and `builder --help` and `builder validate` run from it."""
    import startup

    tree = startup.lay_out(REPO, tmp_path / "head")
    entry_points = next(tree.glob("yamlformer-*.dist-info")).joinpath("entry_points.txt").read_text()
    assert "[yamlformer.commands]" in entry_points and "recipe = yamlformer.recipes.commands.kind:KIND" in entry_points
    assert startup.once(tree, ["--help"]) > 0
    assert startup.once(tree, ["validate", str(REPO / "specs" / "tiny" / "llama.yaml")]) > 0


def test_the_mup_sweep_reports_each_widths_best_point_and_its_interpolated_optimum():
    """benchmarks/mup_transfer.py's report: the best grid point per parametrization and width, and
    the vertex of the parabola through it and its neighbours (an edge point as it is)."""
    import math

    import mup_transfer

    DONE = {"status": "complete"}

    def row(kind, width, exponent, loss):
        return {"variant": kind, "d_model": width, "optimizer.lr": 2.0**exponent, "final_val": loss} | DONE

    rows = [row("mup", 64, e, (e + 7.5) ** 2) for e in range(-10, -4)]  # the optimum between -8 and -7
    rows += [row("standard", 64, e, 5 - e) for e in range(-10, -4)]  # still falling at the grid's edge
    rows += [row("standard", 128, -8, math.nan), row("standard", 128, -9, 1.0)]  # a diverged trial is left out
    assert mup_transfer.best_points(rows) == {"mup": {64: 2.0**-8}, "standard": {64: 2.0**-5, 128: 2.0**-9}}
    vertices = mup_transfer.optima(rows)
    assert math.isclose(vertices["mup"][64], -7.5) and vertices["standard"] == {64: -5.0, 128: -9.0}
    assert mup_transfer.optimum([]) is None
    assert mup_transfer.optimum([(-9, 1.0), (-8, 1.0), (-7, 2.0)]) == -9  # a tie: the first, on the edge
    # seeds are averaged per point before the best is read: a second seed moves 128's best to -10
    second = [row("standard", 128, -9, 3.0), row("standard", 128, -10, 1.5), row("standard", 128, -8, 0.1)]
    points = {(r["d_model"], r["optimizer.lr"]): r for r in mup_transfer.averaged(rows + second)}
    assert points[(128, 2.0**-9)]["final_val"] == 2.0 and points[(128, 2.0**-9)]["seeds"] == 2
    assert math.isnan(points[(128, 2.0**-8)]["final_val"])  # a seed diverged there: the point is out
    assert mup_transfer.best_points(mup_transfer.averaged(rows + second))["standard"][128] == 2.0**-10
