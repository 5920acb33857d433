"""The static decoding step (``yamlformer.blocks.cache``, ``TransformerStack.step``) and its compiled form
(``generate(..., compile=True)``): one token at a fixed shape over preallocated buffers gives the
full forward's logits for every attention with a cache (GQA + RoPE, learned positions, a sliding
window's ring buffer past its wrap, ALiBi, multi-head latent attention, encoder-decoder cross
attention with T5's relative bias), traces as one graph with no break, and the compiled step
decodes the eager step's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hostile_helpers import checkpoint  # noqa: F401  (a fixture: a trained tiny LM checkpoint)

from yamlformer.blocks import generation
from yamlformer.blocks.cache import KVCache
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.spec.schema import spec_model

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

TINY = Path(__file__).resolve().parents[1] / "specs" / "tiny"


def _window_spec(position: str) -> object:
    """Every layer windowed to 5 tokens: a 20-token sequence wraps the ring buffer three times."""
    return spec_model().model_validate(
        {
            "name": "tiny-window",
            "architecture": "decoder-only",
            "vocab_size": 64,
            "d_model": 32,
            "max_seq_len": 64,
            "position": {"type": position},
            "decoder": {
                "n_layers": 2,
                "attention": {"n_heads": 4, "n_kv_heads": 2, "sliding_window": 5},
                "ffn": {"type": "glu", "hidden_dim": 48},
                "norm": {"type": "rmsnorm"},
            },
        }
    )


SPECS = {
    "llama": lambda: load_spec(TINY / "llama.yaml"),  # GQA + RoPE
    "gpt2": lambda: load_spec(TINY / "gpt2.yaml"),  # learned positions
    "alibi": lambda: load_spec(TINY / "alibi.yaml"),
    "window-rope": lambda: _window_spec("rope"),
    "window-alibi": lambda: _window_spec("alibi"),
    "deepseek-v2": lambda: load_spec(TINY / "deepseek-v2.yaml"),  # MLA's compressed cache
    "transformer": lambda: load_spec(TINY / "transformer.yaml"),  # encoder-decoder
    "t5": lambda: load_spec(TINY / "t5.yaml"),  # encoder-decoder, relative bias
}


def _model(spec):
    torch.manual_seed(0)
    return build_model(spec).eval()


def _step_args(model, ids, prefill: int, mask=None, memory=None):
    """A cache prefilled eagerly with ``ids[:, :prefill]``, and the tables a static step reads."""
    rows, total = ids.shape
    cache = KVCache.for_stack(model.decoder, rows, total, torch.float32, "cpu")
    if mask is not None:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = model(ids[:, :prefill], mask[:, :prefill], cache=cache)
    else:
        positions = torch.arange(total).expand(rows, total)
        if memory is not None:
            first = model(None, decoder_input_ids=ids[:, :prefill], memory=memory, cache=cache)
        else:
            first = model(ids[:, :prefill], cache=cache)
    return cache, positions, first


@pytest.mark.parametrize("name", sorted(SPECS))
def test_static_steps_give_the_full_forwards_logits(name):
    spec = SPECS[name]()
    model = _model(spec)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=g)
    memory = None
    with torch.no_grad():
        if spec.architecture == "encoder-decoder":
            src = torch.randint(0, spec.vocab_size, (2, 7), generator=g)
            memory = model.encode(src)
            full = model(src, decoder_input_ids=ids)
        else:
            full = model(ids)
        cache, positions, first = _step_args(model, ids, 6, memory=memory)
        steps = []
        for i in range(6, 20):
            steps.append(model._decode_step(ids[:, i : i + 1], torch.tensor([i]), positions, cache, None, memory, None))
            cache.advance(1)
    torch.testing.assert_close(first, full[:, :6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "window-rope"])
def test_static_steps_under_left_padding(name):
    """A left-padded row: positions count real tokens and the padded slots stay masked."""
    spec = SPECS[name]()
    model = _model(spec)
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, mask)
        cache, positions, _ = _step_args(model, ids, 5, mask=mask)
        steps = []
        for i in range(5, 16):
            steps.append(model._decode_step(ids[:, i : i + 1], torch.tensor([i]), positions, cache, mask, None, None))
            cache.advance(1)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 5:], rtol=1e-4, atol=1e-5)


def test_a_static_cache_refuses_to_overflow():
    model = _model(SPECS["llama"]())
    cache = KVCache.for_stack(model.decoder, 1, 4, torch.float32, "cpu")
    cache.advance(4)
    with pytest.raises(ValueError, match="KV cache full: allocated for 4 tokens"):
        cache.advance(1)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_decode_step_is_one_graph_with_no_break(name):
    model = _model(SPECS[name]())
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        cache, positions, _ = _step_args(model, ids, 7)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(generation._compiled_decode_step)(
            model, ids[:, 7:8].contiguous(), torch.tensor([7]), positions, cache, None, None, None
        )
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [r.reason for r in explained.break_reasons]


@pytest.fixture
def dynamo_only(monkeypatch):
    """The compiled step traced by Dynamo without Inductor's code generation (seconds, not tens)."""
    torch._dynamo.reset()
    monkeypatch.setattr(
        generation,
        "_COMPILED_STEP",
        torch.compile(generation._compiled_decode_step, backend="eager", fullgraph=True, dynamic=False),
    )
    yield
    torch._dynamo.reset()


def test_compiled_generate_equals_eager_and_compiles_once(dynamo_only):
    from torch._dynamo.utils import counters

    spec = SPECS["llama"]()
    model = _model(spec)
    prompt = torch.randint(0, spec.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    eager = model.generate(prompt, 12, attention_mask=mask)
    graphs = counters["stats"]["unique_graphs"]
    compiled = model.generate(prompt, 12, attention_mask=mask, compile=True)
    assert torch.equal(compiled, eager)
    assert model.last_compile_seconds > 0
    assert counters["stats"]["unique_graphs"] == graphs + 1  # one graph serves every position
    one = model.generate(prompt[:1], 12, compile=True)  # batch 1: (1, 1) inputs keep one layout too
    assert torch.equal(one, model.generate(prompt[:1], 12))
    assert counters["stats"]["unique_graphs"] == graphs + 2
    graphs = counters["stats"]["unique_graphs"]
    again = model.generate(prompt, 12, attention_mask=mask, compile=True)  # same shapes: no new graph
    assert torch.equal(again, eager) and counters["stats"]["unique_graphs"] == graphs
    assert model.last_compile_seconds == 0.0
    beams = dict(num_beams=3, max_new_tokens=6)
    assert torch.equal(model.generate(prompt, compile=True, **beams), model.generate(prompt, **beams))
    sample = dict(max_new_tokens=8, temperature=0.9, top_k=20)
    assert torch.equal(
        model.generate(prompt, compile=True, generator=torch.Generator().manual_seed(1), **sample),
        model.generate(prompt, generator=torch.Generator().manual_seed(1), **sample),
    )


def test_compiled_generate_for_encoder_decoder_and_windows(dynamo_only):
    for spec in (SPECS["transformer"](), SPECS["window-rope"]()):
        model = _model(spec)
        src = torch.randint(0, spec.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
        kw = {"decoder_input_ids": src[:, :1]} if spec.architecture == "encoder-decoder" else {}
        assert torch.equal(model.generate(src, 14, compile=True, **kw), model.generate(src, 14, **kw))


def test_a_step_that_is_not_one_graph_decodes_eagerly_with_a_warning(dynamo_only):
    """MoE's sparse dispatch reads expert counts: no single graph; the eager step is exact."""
    spec = SPECS["deepseek-v2"]()
    model = _model(spec)
    prompt = torch.randint(0, spec.vocab_size, (1, 4))
    with pytest.warns(UserWarning, match="does not compile as one graph"):
        compiled = model.generate(prompt, 5, compile=True)
    assert torch.equal(compiled, model.generate(prompt, 5))


def test_compile_argument_is_checked():
    model = _model(SPECS["gpt2"]())
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="compile must be True or False"):
        model.generate(prompt, 2, compile="yes")
    with pytest.raises(ValueError, match="compile=True compiles the cached decoding step; it needs use_cache"):
        model.generate(prompt, 2, compile=True, use_cache=False)
    model.decoder.layers[0].attention.static_decode = False  # an attention that does not declare the step
    with pytest.raises(ValueError, match="MultiHeadAttention does not declare static_decode"):
        model.generate(prompt, 2, compile=True)
    assert model.generate(prompt, 4).shape == (1, 7)  # without compile it feeds tokens through forward


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_inductor_compiled_generate_equals_eager(name):
    """The real thing: Inductor's compiled step decodes eager's tokens (tens of seconds to compile)."""
    spec = SPECS[name]()
    model = _model(spec)
    prompt = torch.randint(0, spec.vocab_size, (2, 6), generator=torch.Generator().manual_seed(7))
    assert torch.equal(model.generate(prompt, 24, compile=True), model.generate(prompt, 24))


def test_builder_generate_compile_prints_the_eager_text(capsys, checkpoint, dynamo_only):
    from hostile_helpers import cli

    argv = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu"]
    eager = cli(capsys, "generate", checkpoint, *argv)
    compiled = cli(capsys, "generate", checkpoint, *argv, "--compile")
    assert eager.status == compiled.status == 0, compiled.text
    assert compiled.out == eager.out and compiled.out.startswith("def ")
