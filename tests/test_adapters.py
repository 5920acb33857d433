"""A spec's ``adapters`` (LoRA, DoRA) on the linear-layer seam: the estimate counts what the built
model trains and freezes, for every adapter type on every kind of layer (attention, MLA's low-rank
projections, FFN, stacked experts, heads, multi-token prediction); an adapted model starts as its
base; the merged weight is what the layer applies; a wrong target is one located line naming the
nearest paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks import registry
from yamlformer.blocks.linear import AdaptedLayer, Adapter, Linear, adapter_parameters, linear_layers
from yamlformer.builder import build_model, estimate, load_spec
from yamlformer.builder.adapters import model_linears
from yamlformer.builder.analysis.report import actual_params
from yamlformer.builder.spec.source import SpecError

REPO = Path(__file__).resolve().parents[1]
#: tiny specs covering every kind of linear layer: GQA attention, MLA with a low-rank query and a
#: DeepSeekMoE (shared and stacked experts), top-k experts, an encoder with BERT's MLM head,
#: DeepSeek-V3's multi-token prediction head, differential attention, an encoder-decoder
SPECS = ("llama", "deepseek-v2", "mixtral", "bert", "deepseek-v3", "diff-transformer", "t5")


def _spec(name: str, adapters: dict | None):
    return load_spec(REPO / "specs" / "tiny" / f"{name}.yaml", overrides={"adapters": adapters} if adapters else {})


def _adapter_cases():
    for type_name, cls in sorted(registry.configs("adapter").items()):
        for i, example in enumerate(cls.examples):
            yield pytest.param({"type": type_name, **example}, id=f"{type_name}-{i}")


@pytest.mark.parametrize("adapters", list(_adapter_cases()))
@pytest.mark.parametrize("name", SPECS)
def test_the_estimate_counts_what_the_built_model_trains(name, adapters):
    try:
        spec = _spec(name, adapters)
    except SpecError as exc:  # an example naming layers this spec has not
        assert "names no linear layer" in str(exc) or "has 0-" in str(exc), exc
        pytest.skip("the example's targets are not in this spec")
    model = build_model(spec, init_seed=0)
    est = estimate(spec, seq_len=8)
    params = list({id(p): p for p in model.parameters()}.values())
    trains = sum(p.numel() for p in params if p.requires_grad)
    assert (est.params.total, est.params.trainable, est.params.frozen) == (
        sum(p.numel() for p in params),
        trains,
        sum(p.numel() for p in params if not p.requires_grad),
    )
    assert trains == sum(p.numel() for p in adapter_parameters(model).values()) > 0
    assert actual_params(model) == {k: v for k, v in est.params.by_component.items() if v}
    # the torch-free list of linear layers is the built model's
    assert set(model_linears(spec)) == set(linear_layers(model))
    # only the adapters keep gradients and optimizer state
    m = est.memory
    tensors = sum(p.requires_grad for p in params)  # AdamW: two fp32 states an element, an fp32 step a tensor
    assert m.gradients == trains * 2 and m.optimizer == trains * 8 + tensors * 4 and m.master_weights == trains * 4
    assert m.weights == (est.params.total - trains) * 2 + trains * 2


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapter_flops_are_what_the_model_computes(kind):
    spec = _spec("mixtral", {"type": kind, "rank": 4, "targets": "all-linear"})
    model = build_model(spec, attention_backend="eager", init_seed=0).eval()
    ids = torch.randint(0, spec.vocab_size, (1, 12))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    assert estimate(spec, seq_len=12).flops.forward_per_sequence == counter.get_total_flops()


@pytest.mark.parametrize("name", ["llama", "deepseek-v2", "mixtral"])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_adapted_model_starts_as_its_base_and_merges_into_it(name, kind):
    base = build_model(_spec(name, None), init_seed=3).eval()
    spec = _spec(name, {"type": kind, "rank": 4, "alpha": 8, "targets": "all-linear"})
    model = build_model(spec, init_seed=3).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)
        for p in adapter_parameters(model).values():  # a trained adapter: every factor moved
            p.add_(0.05 * torch.randn_like(p))
        adapted = model(ids)
        for path, linear in linear_layers(model).items():  # each layer applies its merged weight
            if linear.adapter is None:
                continue
            x = torch.randn(7, linear.in_features)
            weight = linear.adapted_weight()
            if weight.ndim == 3:  # stacked experts: each expert's rows through its own slice
                counts = torch.tensor([3, 0, 4] + [0] * (weight.shape[0] - 3))
                want = torch.cat([x[:3] @ weight[0].T, x[3:] @ weight[2].T])
                got = linear(x, counts) - (0 if linear.bias is None else linear.bias.repeat_interleave(counts, 0))
            else:
                want, got = x @ weight.T, linear(x) - (0 if linear.bias is None else linear.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=path)
    assert not torch.allclose(adapted, base(ids))


def test_stacked_experts_adapt_alike_by_grouped_matmul_and_by_loop():
    spec = _spec("mixtral", {"type": "dora", "rank": 4, "targets": ["experts"]})
    model = build_model(spec, init_seed=1).eval()
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, spec.vocab_size, (2, 16))
        grouped = model(ids)
        for module in model.modules():
            if hasattr(module, "grouped_mm"):
                module.grouped_mm = False
        torch.testing.assert_close(model(ids), grouped, rtol=1e-5, atol=1e-5)


def test_mla_decodes_with_an_adapted_kv_b_proj_as_it_recomputes():
    spec = _spec("deepseek-v2", {"type": "lora", "rank": 4, "targets": ["kv_b_proj", "kv_a_proj_with_mqa"]})
    model = build_model(spec, init_seed=0, attention_backend="eager").eval()
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, spec.vocab_size, (1, 6))
    cached = model.generate(ids, max_new_tokens=6)
    assert torch.equal(cached, model.generate(ids, max_new_tokens=6, use_cache=False))


def test_targets_select_layers_by_path_range_and_name():
    linears = set(model_linears(_spec("llama", None)))
    cases = {
        ("q_proj",): {p for p in linears if p.endswith("q_proj")},
        ("decoder.layers.1.ffn",): {p for p in linears if p.startswith("decoder.layers.1.ffn.")},
        ("decoder.layers.0-1.attention.v_proj",): {p for p in linears if p.endswith("v_proj")},
        ("head.proj",): {"head.proj"},
    }
    for targets, want in cases.items():
        model = build_model(_spec("llama", {"type": "lora", "rank": 2, "targets": list(targets)}), device="meta")
        assert {p for p, linear in linear_layers(model).items() if linear.adapter is not None} == want, targets
    model = build_model(_spec("llama", {"type": "lora", "rank": 2, "targets": "all-linear"}), device="meta")
    adapted = {p for p, linear in linear_layers(model).items() if linear.adapter is not None}
    assert adapted == linears - {"head.proj"}


def test_a_wrong_target_is_one_located_line_naming_the_nearest_paths(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "extends: " + str(REPO / "specs" / "tiny" / "llama.yaml") + "\n"
        "adapters:\n  type: lora\n  targets:\n    - q_proj\n    - decoder.layers.*.attention.q\n"
    )
    with pytest.raises(SpecError) as caught:
        load_spec(spec)
    [problem] = caught.value.problems
    assert (problem.path, problem.line) == ("adapters.targets.1", 6)
    assert "names no linear layer; nearest:" in problem.message
    assert "decoder.layers.*.attention.q_proj" in problem.message
    spec.write_text(spec.read_text().replace("attention.q\n", "attention\n").replace("*.", "0-7."))
    with pytest.raises(SpecError, match=r"adapters.targets.1: 'decoder.layers.0-7.attention': decoder.layers has 0-1"):
        load_spec(spec)


def test_a_recipe_names_a_wrong_target_at_its_own_line(tmp_path):
    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe

    path = tiny_recipe(tmp_path, model={"adapters": {"type": "dora", "targets": ["attention.qproj"]}})
    text = path.read_text()
    with pytest.raises(SpecError) as caught:
        model_spec(load_recipe(path), vocab_size=64)
    [problem] = caught.value.problems
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "attention.qproj" in row)
    assert (problem.path, problem.line, Path(problem.file).name) == ("model.adapters.targets.0", line, "recipe.yaml")
    assert "nearest: attention.q_proj" in problem.message


def test_an_adapter_type_must_be_registered_and_its_fields_known():
    with pytest.raises(
        SpecError, match=r"adapters.type: unknown type 'lorax'; did you mean 'lora'\? \(one of: lora, dora\)"
    ):
        _spec("llama", {"type": "lorax", "targets": "all-linear"})
    with pytest.raises(SpecError, match="unknown key 'ranks'|ranks"):
        _spec("llama", {"type": "lora", "ranks": 4, "targets": "all-linear"})


@pytest.mark.parametrize("adapters", list(_adapter_cases()))
def test_every_adapter_and_every_layer_it_adapts_keep_the_declared_contract(adapters):
    """What the seam declares (``yamlformer.blocks.linear.Adapter``, ``AdaptedLayer``) is what each
    registered adapter type and each kind of linear layer has: a plugin's adapter is checked too,
    and one that lacks a member is refused when attached, naming it."""
    for name in ("mixtral", "llama"):  # stacked experts and single projections
        try:
            model = build_model(_spec(name, adapters), init_seed=0)
        except SpecError:
            continue  # the example's targets are not in this spec
        adapted = [layer for layer in linear_layers(model).values() if layer.adapter is not None]
        assert adapted
        for layer in adapted:
            assert isinstance(layer, AdaptedLayer) and isinstance(layer.adapter, Adapter)

    class Halfway(torch.nn.Module):
        feature_dims: dict = {}

        def forward(self, x, y, linear, **where):
            return y

    with pytest.raises(TypeError, match=r"Halfway is not an adapter .*: it lacks init_rules, merged_weight, set_from"):
        Linear(4, 4).attach(Halfway())
