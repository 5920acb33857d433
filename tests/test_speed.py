"""The speed levers: torch.compile on every family (graph breaks counted), the compile cache in the
run folder, fused AdamW (precision: tests/test_precision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from recipe_helpers import tiny_recipe

SPECS = Path(__file__).resolve().parents[1] / "specs" / "tiny"


def _model_and_loss(name: str):
    from yamlformer.builder import build_model, load_spec

    spec = load_spec(SPECS / f"{name}.yaml")
    torch.manual_seed(0)
    model = build_model(spec)
    ids = torch.randint(0, spec.vocab_size, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # padding: the masked paths are traced too

    def loss():
        if spec.architecture == "encoder-decoder":
            out = model(ids, mask, decoder_input_ids=ids[:, :10], decoder_attention_mask=mask[:, :10])
        elif spec.architecture == "encoder-only":
            out = model(ids, mask)
        else:
            out = model(ids)
        return out.float().square().mean()

    return spec, model, loss


#: dense families: one graph, no break. Mixtral's sparse dispatch sorts tokens by expert and
#: slices by data-dependent counts: breaks in that dispatch (yamlformer.blocks.experts), nowhere else.
DENSE = ["gpt2", "llama", "alibi", "gemma2", "bert", "t5", "transformer"]


@pytest.mark.parametrize("name", [*DENSE, "mixtral"])
def test_every_family_traces_and_counts_its_graph_breaks(name):
    spec, model, loss = _model_and_loss(name)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)()
    if name in DENSE:
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
            r.reason for r in explained.break_reasons
        ]
    else:  # every break is in the sparse expert dispatch and its per-expert matmuls (yamlformer.blocks.experts)
        import inspect

        from yamlformer.blocks import experts

        assert explained.graph_break_count > 0
        for reason in explained.break_reasons:
            frame = reason.user_stack[-1]
            assert frame.filename == inspect.getsourcefile(experts), reason.reason


#: the families compiled in the default suite (every one with -m slow)
COMPILED = ("llama", "mixtral")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in COMPILED else [pytest.mark.slow]) for n in [*DENSE, "mixtral"]]
)
def test_compiled_forward_and_backward_match_eager(name):
    """AOTAutograd's joint graph (what Inductor compiles) gives eager's loss and gradients
    (dropout off: its random draws differ between the two)."""
    _, model, loss = _model_and_loss(name)
    model.eval()
    expected = loss()
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager")()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("name", DENSE + ["mixtral"])
def test_inductor_compiles_every_family(name):
    _, model, loss = _model_and_loss(name)
    model.eval()
    expected = loss()
    torch._dynamo.reset()
    got = torch.compile(loss)()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # 30 s: two compiled training runs
def test_compiled_run_keeps_its_cache_and_a_resumed_run_reuses_it(tmp_path):
    """``trainer.compile: model``: Inductor writes its graphs under the run folder; the resumed
    run (its in-memory caches cleared) loads them instead of compiling again; the losses are the
    eager run's."""
    from torch._dynamo.utils import counters

    from yamlformer.recipes.training.run import run

    trainer = {"max_steps": 6, "val_check_interval": 6, "checkpoint_every_n_steps": 3, "log_every_n_steps": 3}
    schedule = {"type": "constant", "warmup_steps": 0}  # the same rates whatever max_steps the first part has
    compiled = tiny_recipe(tmp_path, trainer=dict(trainer, compile="model"), schedule=schedule)
    torch._dynamo.reset()
    counters.clear()
    first = run(compiled, {"trainer.max_steps": 3}, samples=False)
    cache = Path(first["output_dir"]) / "compile-cache"
    assert first["compile_seconds"] > 0 and any(cache.rglob("*"))
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1

    torch._dynamo.reset()
    counters.clear()
    resumed = run(compiled, samples=False)
    assert resumed["steps"] == 6
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0

    eager_dir = tmp_path / "eager"
    eager_dir.mkdir()
    eager = run(tiny_recipe(eager_dir, trainer=trainer, schedule=schedule), samples=False)
    history = lambda summary: torch.load(summary["last"], weights_only=True)["builder"]["history"]
    assert [s for s, _ in history(resumed)["train"]] == [3, 6]
    torch.testing.assert_close(
        torch.tensor([x for _, x in history(resumed)["train"]]),
        torch.tensor([x for _, x in history(eager)["train"]]),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.slow  # ~30 s: a cold compile of each layer (the model-mode run above is the default suite's)
def test_layers_mode_compiles_each_layer_in_place_and_decodes_eagerly(tmp_path):
    from yamlformer.recipes.parallel.compile import compile_layers
    from yamlformer.recipes.training.run import run

    _, model, loss = _model_and_loss("llama")
    names = list(model.state_dict())
    compile_layers(list(model.decoder.layers))
    assert list(model.state_dict()) == names  # in place: checkpoints keep their names
    summary = run(tiny_recipe(tmp_path, trainer={"max_steps": 4, "compile": "layers"}), samples=True)
    assert summary["steps"] == 4 and summary["compile_seconds"] > 0


def test_fused_adamw_where_torch_has_the_kernel():
    from yamlformer.builder.optim.configs import AdamWConfig
    from yamlformer.recipes.optim.torch_optimizers import adamw

    params = [torch.nn.Parameter(torch.randn(3, 3))]
    assert adamw(AdamWConfig(), [{"params": params}]).defaults["fused"]
    ints = [torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)]
    assert adamw(AdamWConfig(), [{"params": ints}]).defaults["foreach"]
