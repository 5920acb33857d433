"""Optimizers as registered kinds (``yamlformer.builder.optim``, ``yamlformer.recipes.optim``): a recipe's
``optimizer:`` by type (AdamW when it names none, as every recipe before types); Muon equals
``torch.optim.Muon`` where torch's takes the tensor, steps stacked experts matrix by matrix, and
its AdamW groups equal ``torch.optim.AdamW``; the groups each kind declares; the state each
declares is what torch holds after a step; one state dict, resumable; bad input located."""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from recipe_helpers import TINY_SPEC, tiny_recipe

from yamlformer.builder import build_model, load_spec
from yamlformer.builder.analysis.shards import optimizer_bytes
from yamlformer.builder.optim import OptimizerConfig, OptimizerError, StateBytes, optimizer_configs, register
from yamlformer.builder.optim.configs import AdamWConfig, MuonConfig, SGDConfig
from yamlformer.builder.optim.registry import grouped
from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.optim import build_optimizer, param_groups
from yamlformer.recipes.optim.muon import Muon, newton_schulz
from yamlformer.recipes.tasks import load_recipe

SPEC = {**TINY_SPEC, "vocab_size": 40}
MOE = {
    **SPEC,
    "tie_embeddings": False,
    "decoder": {
        **SPEC["decoder"],
        "ffn": {"type": "moe", "n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 24}},
    },
}


def _step(model, optimizer, seed: int = 0) -> None:
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(seed))
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, 40).float(), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_muon_steps_a_matrix_as_torch_optim_muon_and_the_rest_as_adamw():
    torch.manual_seed(0)
    matrix, vector = torch.randn(24, 16), torch.randn(16)
    ours = [torch.nn.Parameter(matrix.clone()), torch.nn.Parameter(vector.clone())]
    theirs = [torch.nn.Parameter(matrix.clone()), torch.nn.Parameter(vector.clone())]
    mine = Muon(
        [
            {"params": ours[:1], "lr": 0.02, "weight_decay": 0.1, "muon": True},
            {"params": ours[1:], "lr": 3e-3, "weight_decay": 0.0},
        ],
        ns_precision="bf16",  # torch.optim.Muon's (auto is fp32 on a CPU)
    )
    torch_muon = torch.optim.Muon(theirs[:1], lr=0.02, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(theirs[1:], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    for step in range(4):
        grads = torch.randn(24, 16, generator=torch.Generator().manual_seed(step)), torch.randn(16)
        for params in (ours, theirs):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        mine.step()
        torch_muon.step()
        torch_adamw.step()
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_stacked_experts_are_orthogonalised_one_by_one():
    stack = torch.randn(3, 8, 5)
    together = newton_schulz(stack, 5, torch.float32)
    for i in range(3):
        assert torch.allclose(together[i], newton_schulz(stack[i], 5, torch.float32), atol=1e-6)
    singular = torch.linalg.svdvals(together[0])
    assert singular.min() > 0.5 and singular.max() < 1.5  # near-orthogonal: Keller Jordan's S' in (0.5, 1.5)


def test_each_kind_declares_its_groups():
    model = build_model(load_spec(MOE), init_seed=0)
    model.decoder.layers[0].requires_grad_(False)  # frozen: in no group (an adapter's frozen base alike)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(MuonConfig(lr=0.02, adamw_lr=3e-3), model)
    muon = {names[id(p)] for g in groups if g["muon"] for p in g["params"]}
    rest = {names[id(p)] for g in groups if not g["muon"] for p in g["params"]}
    assert muon == {
        f"decoder.layers.1.{n}.weight"
        for n in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.out_proj")
    } | {f"decoder.layers.1.ffn.experts.{n}" for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
    assert (
        "decoder.embedding.tokens.weight" in rest
        and "head.proj.weight" in rest
        and "decoder.layers.1.ffn.router.weight" in rest
    )
    assert not any(n.startswith("decoder.layers.0.") for n in muon | rest)
    assert {g["lr"] for g in groups if g["muon"]} == {0.02} and {g["lr"] for g in groups if not g["muon"]} == {3e-3}
    adamw = param_groups(AdamWConfig(weight_decay=0.1), model)
    assert [g["weight_decay"] for g in adamw] == [0.1, 0.0]  # decayed first, as every AdamW checkpoint has them
    sgd = param_groups(SGDConfig(lr=0.1, weight_decay=1e-4), model)
    assert {g["lr"] for g in sgd} == {0.1}


@pytest.mark.parametrize(
    "optimizer",
    [AdamWConfig(), MuonConfig(), SGDConfig(), SGDConfig(momentum=0.0)],
    ids=["adamw", "muon", "sgd", "plain-sgd"],
)
def test_the_declared_state_is_what_torch_holds_after_a_step(optimizer):
    spec = load_spec(MOE)
    model = build_model(spec, init_seed=0)
    torch_optimizer = build_optimizer(optimizer, model)
    for p in model.parameters():  # every parameter stepped (a router's unused expert rows too)
        p.grad = torch.zeros_like(p)
    torch_optimizer.step()
    held = sum(
        t.numel() * t.element_size() for s in torch_optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    assert held == optimizer_bytes(spec, optimizer)


def test_a_muon_state_dict_resumes_as_an_unbroken_run():
    spec = load_spec(SPEC)
    straight = build_model(spec, init_seed=0)
    opt = build_optimizer(MuonConfig(), straight)
    for step in range(4):
        _step(straight, opt, step)
    first = build_model(spec, init_seed=0)
    opt = build_optimizer(MuonConfig(), first)
    for step in range(2):
        _step(first, opt, step)
    saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()))
    resumed = build_model(spec, init_seed=1)
    resumed.load_state_dict(saved[0])
    opt = build_optimizer(MuonConfig(), resumed)
    opt.load_state_dict(saved[1])
    for step in range(2, 4):
        _step(resumed, opt, step)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_a_recipe_names_its_optimizer_by_type(tmp_path):
    plain = load_recipe(tiny_recipe(tmp_path, optimizer={"lr": 3e-3})).recipe
    assert isinstance(plain.optimizer, AdamWConfig) and plain.optimizer.lr == 3e-3  # no type: AdamW, as always
    muon = load_recipe(tiny_recipe(tmp_path, optimizer={"type": "muon", "adamw_lr": 1e-3})).recipe
    assert isinstance(muon.optimizer, MuonConfig) and muon.optimizer.adamw_lr == 1e-3
    assert load_recipe(tiny_recipe(tmp_path), {"optimizer.type": "sgd", "optimizer.lr": 0.5}).recipe.optimizer.lr == 0.5
    for bad, message in (
        ({"type": "lion"}, "no optimizer named 'lion'; registered: adamw, muon, sgd"),
        ({"type": "muon", "lrr": 0.1}, "unknown key 'lrr'; did you mean 'lr'"),
        ({"type": "sgd", "momentum": 1.5}, "less than 1"),
    ):
        path = tiny_recipe(tmp_path, optimizer=bad)
        with pytest.raises(SpecError) as info:
            load_recipe(path)
        (problem,) = info.value.problems
        assert problem.file == str(path) and problem.path.startswith("optimizer") and message in problem.message
        assert (
            "optimizer:" in path.read_text().splitlines()[problem.line - 2 if problem.path == "optimizer.type" else 0]
            or problem.line
        )


class _Lion(OptimizerConfig):
    """A plugin's optimizer, as a package registers one (torch's SGD stands in for its class)."""

    type: Literal["test_lion"] = "test_lion"
    lr: float = 1e-4
    momentum: float = 0.0
    nesterov: bool = False

    @property
    def peak_lr(self) -> float:
        return self.lr

    def groups(self, params):
        return grouped((0, {"lr": self.lr, "weight_decay": 0.0}) for _ in params)

    def state(self, role, ndim):
        return StateBytes(per_element=0)


def test_a_registered_plugin_optimizer_joins_recipes_and_estimates(tmp_path, monkeypatch):
    from yamlformer.builder.optim import registry
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.optim import implementations, implements, torch_optimizers

    monkeypatch.setattr(registry, "OPTIMIZERS", registry.OPTIMIZERS.copy())  # this test's alone
    monkeypatch.setattr(implementations, "IMPLEMENTATIONS", implementations.IMPLEMENTATIONS.copy())
    register(_Lion)
    assert optimizer_configs()["test_lion"] is _Lion
    recipe = load_recipe(tiny_recipe(tmp_path, optimizer={"type": "test_lion", "lr": 0.01})).recipe
    assert isinstance(recipe.optimizer, _Lion)
    model = build_model(load_spec(SPEC), init_seed=0)
    with pytest.raises(RecipeError, match=r"'test_lion' has no torch side; register one with @yamlformer.recipes"):
        build_optimizer(recipe.optimizer, model)
    implements("test_lion")(torch_optimizers.sgd)  # the plugin's torch side, registered by its module
    assert isinstance(build_optimizer(recipe.optimizer, model), torch.optim.SGD)
    assert optimizer_bytes(load_spec(SPEC), "test_lion") == 0

    class Twin(_Lion):
        type: Literal["test_lion"] = "test_lion"

    with pytest.raises(OptimizerError, match="already registered"):
        register(Twin)


def test_muon_with_no_hidden_matrix_to_train_is_a_located_error(tmp_path):
    """What the training module asks before any step (``LMModule.__init__``), on a model whose
    layers are all frozen (``model.freeze: [decoder.layers]``): no matrix is left for Muon."""
    from yamlformer.recipes.optim import check_optimizer

    path = tiny_recipe(tmp_path, optimizer={"type": "muon"})
    recipe = load_recipe(path).recipe
    model = build_model(load_spec(SPEC), init_seed=0)
    model.decoder.layers.requires_grad_(False)
    with pytest.raises(SpecError) as info:
        check_optimizer(recipe.optimizer, model, path)
    (problem,) = info.value.problems
    assert (problem.file, problem.path) == (str(path), "optimizer.type")
    assert problem.line == next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "type: muon" in line)
    assert "muon trains 2-D hidden weights" in problem.message
    check_optimizer(AdamWConfig(), model, path)  # AdamW trains what is left


def test_a_package_registers_its_optimizer_through_the_entry_point_group(tmp_path, monkeypatch):
    import importlib.metadata

    from yamlformer.builder.optim import registry
    from yamlformer.builder.spec import plugins

    (tmp_path / "my_optimizers.py").write_text(
        "from typing import Literal\n\nfrom test_optimizers import _Lion\n"
        "from yamlformer.builder.optim import register\n\n"
        "class Lion2(_Lion):\n    type: Literal['test_lion2'] = 'test_lion2'\n\n"
        "register(Lion2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "OPTIMIZERS", registry.OPTIMIZERS.copy())
    monkeypatch.setattr(plugins, "_entry_points_loaded", [False])
    entry = importlib.metadata.EntryPoint("lion2", "my_optimizers", "yamlformer.optimizers")
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: importlib.metadata.EntryPoints([entry] if group == "yamlformer.optimizers" else []),
    )
    assert plugins.load_plugins() == ["my_optimizers"]
    assert "test_lion2" in optimizer_configs()


def test_every_optimizer_type_has_its_torch_side_registered_by_the_recipes():
    """The builder's optimizers and the recipes' implementations are one registry helper's two
    instances, and every built-in type has both halves (the recipes register theirs, the builder
    names no module of theirs)."""
    from yamlformer.blocks import registry as blocks
    from yamlformer.blocks.registrable import Registry
    from yamlformer.builder.optim import OPTIMIZERS
    from yamlformer.recipes.optim import IMPLEMENTATIONS, implementation

    assert all(isinstance(r, Registry) for r in (OPTIMIZERS, IMPLEMENTATIONS, *blocks.REGISTRIES.values()))
    assert list(OPTIMIZERS) == ["adamw", "sgd", "muon"] and set(IMPLEMENTATIONS) == set(OPTIMIZERS)
    assert implementation(MuonConfig()).__module__ == "yamlformer.recipes.optim.muon"
    with pytest.raises(OptimizerError, match="no optimizer named 'lion'; registered: adamw, muon, sgd"):
        OPTIMIZERS.get("lion")
