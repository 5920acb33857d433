"""muP declared in the spec (``yamlformer.builder.parametrization``): every block declares its tensors'
classes; at the base width a muP spec trains bit for bit as the standard one (AdamW and Muon,
tied embeddings, GQA, MLA, MoE, every position type); away from it the init, learning rates,
attention scale and output multiplier follow the width; activations stay the same size across
widths under muP and grow under the standard parametrization (the coordinate check); bad input
is a located error."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from recipe_helpers import TINY_SPEC

from yamlformer.blocks import registry
from yamlformer.blocks.configs.tensors import TensorClass
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.optim.configs import AdamWConfig, MuonConfig
from yamlformer.builder.parametrization import plan
from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.optim import build_optimizer, param_groups

ROOT = Path(__file__).resolve().parents[1]
#: the dimensions each kind's counts take, for the registry walk (heads: with and without a tied projection)
DIMS = {
    "attention": [(32,)],
    "ffn": [(32,)],
    "norm": [(32,)],
    "position": [(32, 4, 16)],
    "head": [(32, 50, False), (32, 50, True)],
}


def test_every_built_in_block_declares_a_class_for_each_tensor():
    for kind, dims in DIMS.items():
        for name, cls in registry.configs(kind).items():
            if not cls.__module__.startswith("yamlformer."):
                continue  # a plugin's may leave them out (muP and Muon then refuse it, located)
            for example in cls.examples:
                config = cls.model_validate(example)
                for args in dims:
                    shapes, classes = config.param_shapes(*args), config.tensor_classes(*args)
                    assert classes is not None, f"{kind} {name} declares no tensor classes"
                    assert all(isinstance(c, TensorClass) for c in classes.values())
                    tied_head = kind == "head" and args[-1]
                    # a tied head also names its projection, whose module takes the output multiplier
                    assert set(shapes) <= set(classes) if tied_head else set(shapes) == set(classes), (kind, name)


def _mup(spec: dict, base: int, **fields) -> dict:
    return {**copy.deepcopy(spec), "parametrization": {"type": "mup", "base_d_model": base, **fields}}


def _train(spec, optimizer, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps of a fixed batch from seed 0 (dropout's too); the weights after them."""
    torch.manual_seed(0)
    model = build_model(spec, init_seed=0, attention_backend="eager")
    opt = build_optimizer(optimizer, model)
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


#: tied embeddings and GQA (llama), MLA and MoE (deepseek-v2), learned positions (gpt2), ALiBi,
#: an encoder with its MLM head (bert), differential attention, multi-token prediction (deepseek-v3)
FAMILIES = ["llama", "deepseek-v2", "gpt2", "alibi", "bert", "diff-transformer", "deepseek-v3"]


#: Muon in the default run on stacked experts (deepseek-v2) and tied GQA (llama); every family slow
CASES = [pytest.param("adamw", family, id=f"adamw-{family}") for family in FAMILIES] + [
    pytest.param(
        "muon", family, id=f"muon-{family}", marks=() if family in ("llama", "deepseek-v2") else pytest.mark.slow
    )
    for family in FAMILIES
]
OPTIMIZERS = {"adamw": AdamWConfig(lr=1e-2), "muon": MuonConfig(adamw_lr=1e-2)}


@pytest.mark.parametrize("optimizer, family", CASES)
def test_mup_at_its_base_width_trains_bit_for_bit_as_the_standard_spec(optimizer, family):
    optimizer = OPTIMIZERS[optimizer]
    standard = load_spec(ROOT / "specs" / "tiny" / f"{family}.yaml")
    mup = load_spec(_mup(standard.model_dump(exclude={"extends"}), standard.d_model))
    before, after = _train(standard, optimizer), _train(mup, optimizer)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before), family


def test_away_from_the_base_width_init_learning_rates_scores_and_output_follow_it():
    tiny = {**TINY_SPEC, "vocab_size": 95}
    base, wide = load_spec(tiny), load_spec(_mup(tiny, base=8, base_head_dim=4))  # d_model 32: m = 4
    made = plan(wide)
    q = made.tensors["decoder.layers.0.attention.q_proj.weight"]
    assert (q.role, q.fan_in, q.fan_out) == ("hidden", 4.0, 4.0)
    down = made.tensors["decoder.layers.0.ffn.down_proj.weight"]  # its inputs span the FFN width
    assert down.fan_in == 4.0 and made.tensors["decoder.embedding.tokens.weight"].role == "input"
    assert made.output_multipliers == {"head.proj": 0.25}  # tied: the head's module still takes it

    a, b = build_model(base, init_seed=3), build_model(wide, init_seed=3)
    name = "decoder.layers.1.attention.out_proj.weight"
    assert torch.allclose(b.get_parameter(name), a.get_parameter(name) / 2)  # std / sqrt(4)
    assert torch.equal(
        b.get_parameter("decoder.embedding.tokens.weight"), a.get_parameter("decoder.embedding.tokens.weight")
    )
    head_dim = 16  # 32 / 2 heads; base_head_dim 4: scores x sqrt(4 / 16), the scale 1/head_dim from the base's
    assert b.decoder.layers[0].attention.scale == pytest.approx(head_dim**-0.5 * 0.5)
    seen = {}
    b.decoder.final_norm.register_forward_hook(lambda m, args, out: seen.update(hidden=out))
    b.head.proj.register_forward_hook(lambda m, args, out: seen.update(projected=args[0]))
    b(torch.randint(0, 95, (1, 8)))
    assert torch.equal(seen["projected"], seen["hidden"] * 0.25)  # the logits' input times alpha / m

    lrs = {id(p): g["lr"] for g in param_groups(AdamWConfig(lr=1.0), b) for p in g["params"]}
    assert lrs[id(b.get_parameter(name))] == 0.25 and lrs[id(b.get_parameter("decoder.embedding.tokens.weight"))] == 1.0
    muon = {id(p): (g["lr"], g["muon"]) for g in param_groups(MuonConfig(lr=1.0, adamw_lr=0.5), b) for p in g["params"]}
    assert muon[id(b.get_parameter(name))] == (1.0, True)  # a square matrix's spectral update needs no factor
    assert muon[id(b.get_parameter("decoder.final_norm.weight"))] == (0.5, False)


def _rms_after_steps(width: int, mup: bool, steps: int = 4) -> float:
    """The RMS of the last layer's output (the head's input) after ``steps`` AdamW steps at one
    learning rate: the coordinate check of Yang et al. 2022, figure 5."""
    spec = {
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": width,
        "max_seq_len": 16,
        "position": {"type": "rope"},
        "decoder": {"n_layers": 2, "attention": {"n_heads": 4}, "ffn": {"type": "mlp"}, "norm": {"type": "rmsnorm"}},
    }
    spec = load_spec(_mup(spec, base=64) if mup else spec)
    torch.manual_seed(0)
    model = build_model(spec, init_seed=0)
    opt = build_optimizer(AdamWConfig(lr=1e-2, weight_decay=0.0), model)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    captured = {}
    layer = model.decoder.layers[-1]
    handle = layer.register_forward_hook(lambda m, i, out: captured.update(out=out))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return float(captured["out"].float().pow(2).mean().sqrt())


@pytest.mark.parametrize(
    "widths",
    [
        pytest.param((64, 128, 256), id="64-256"),
        pytest.param((64, 128, 256, 512, 1024), id="64-1024", marks=pytest.mark.slow),
    ],
)
def test_coordinate_check_activations_stay_flat_under_mup_and_grow_under_standard(widths):
    # the range, 64..1024, under -m slow (benchmarks/RESULTS.md, "muP coordinate check")
    mup = [_rms_after_steps(w, mup=True) for w in widths]
    standard = [_rms_after_steps(w, mup=False) for w in widths]
    print("coordinate check RMS by width", widths, "mup", mup, "standard", standard)
    # muP: no doubling moves the RMS by a quarter (measured, 64..1024: x0.81 x0.89 x0.93 x0.93, settling);
    # standard: every doubling more than doubles it (x4.2 x4.7 x3.9 x4.9)
    assert all(0.75 < wider / narrower < 1.25 for narrower, wider in zip(mup, mup[1:])), mup
    assert all(wider > 2 * narrower for narrower, wider in zip(standard, standard[1:])), standard


def test_a_base_wider_than_the_model_is_a_located_error(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text(
        f"extends: {ROOT / 'specs' / 'tiny' / 'llama.yaml'}\nparametrization:\n  type: mup\n  base_d_model: 128\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert (problem.file, problem.line, problem.path) == (str(path), 4, "parametrization.base_d_model")
    assert "larger than d_model (64)" in problem.message


def test_a_block_without_tensor_classes_is_a_located_error_under_mup(tmp_path):
    """Through the command, in a child process: a plugin's blocks would stay in this process's registry."""
    import os
    import subprocess
    import sys

    import yaml

    spec = _mup(TINY_SPEC, base=16)
    spec.update(vocab_size=64, position={"type": "interleaved_rope"})
    spec["decoder"]["attention"] = {
        "type": "lowrank_kv",
        "n_heads": 2,
        "kv_rank": 8,
        "head_dim": 8,
        "rope_dim": 4,
        "v_head_dim": 8,
    }
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    child = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "validate", str(path), "--plugin", "plugin_blocks"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests")),
    )
    assert child.returncode == 1, child.stdout + child.stderr
    lines = [line for line in (child.stdout + child.stderr).splitlines() if "tensor classes" in line]
    assert lines, child.stdout + child.stderr
    line = lines[0]
    assert line.startswith(f"{path}:") and ": decoder.attention.type: lowrank_kv declares no tensor classes" in line


def test_describe_and_diff_show_the_parametrization(tmp_path, capsys):
    import json

    from yamlformer.builder.cli import main

    standard = ROOT / "specs" / "tiny" / "llama.yaml"
    wide = tmp_path / "mup.yaml"
    wide.write_text(f"extends: {standard}\nparametrization: {{type: mup, base_d_model: 16}}\n")
    assert main(["describe", str(wide), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["parametrization"]
    assert shown["type"] == "mup" and shown["widths"]["d_model"] == 4.0 and shown["attention_score_factor"] == 0.5
    assert shown["hidden_adamw_lr_factors"] == [0.25]
    assert main(["diff", str(standard), str(wide)]) == 0
    out = capsys.readouterr().out
    assert "parametrization.type" in out and "mup from base_d_model 16 (width ratio 4" in out
    assert "hidden matrices: init std x 0.5; AdamW lr x 0.25" in out
