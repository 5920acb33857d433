"""Whole models from specs: every spec builds on meta in under 2 s with the estimated parameter
count; tiny specs build fast, run forward and backward, agree across attention backends, match
the estimated FLOPs, respect causality and padding; initialisation follows yamlformer.blocks.init."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.builder import build_model, load_spec
from yamlformer.builder.spec.schema import spec_model

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").rglob("*.yaml"))
TINY = [p for p in SPECS if "tiny" in str(p.relative_to(ROOT))]


def _ids(p: Path) -> str:
    return str(p.relative_to(ROOT / "specs").with_suffix(""))


def _estimate(spec, **kw):
    from yamlformer.builder.analysis.estimates import estimate

    return estimate(spec, **kw)


def _run(model, spec, ids, mask=None, target=None):
    if spec.architecture == "encoder-decoder":
        return model(ids, mask, decoder_input_ids=ids if target is None else target)
    return model(ids, mask)


def _tiny_inputs(spec, batch=2, seq=12, seed=0):
    return torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_specs_are_found():
    assert len(SPECS) >= 10 and len(TINY) >= 5


@pytest.mark.parametrize("path", SPECS, ids=_ids)
def test_every_spec_builds_on_meta_fast_with_the_estimated_parameters(path):
    spec = load_spec(path)
    start = time.process_time()  # this process's CPU time: a loaded machine does not fail it
    model = build_model(spec, device="meta")
    elapsed = time.process_time() - start
    assert elapsed < 2.0, f"{path.name}: meta build took {elapsed:.2f} s of CPU"
    assert all(p.is_meta for p in model.parameters())
    assert model.spec is spec
    assert model.n_params() == _estimate(spec, seq_len=8).params.total


@pytest.mark.parametrize("path", TINY, ids=_ids)
def test_tiny_spec_builds_fast_and_trains(path):
    spec = load_spec(path)
    start = time.process_time()
    model = build_model(spec)
    assert time.process_time() - start < 1.0
    ids = _tiny_inputs(spec)
    out = _run(model, spec, ids)
    if type(spec.head).projects_to_vocab:
        assert out.shape == (2, 12, spec.vocab_size)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())
    else:
        loss = out.float().pow(2).mean()
    (loss + sum(model.aux_losses().values())).backward()  # a head's losses too (multi-token prediction)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("path", TINY, ids=_ids)
def test_eager_and_sdpa_backends_agree(path):
    spec = load_spec(path)
    torch.manual_seed(0)
    eager = build_model(spec, attention_backend="eager")
    sdpa = build_model(spec, attention_backend="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    eager.eval(), sdpa.eval()  # no dropout (gradients still flow)
    ids = _tiny_inputs(spec)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # padding too
    for m in (None, mask):
        a, b = _run(eager, spec, ids, m), _run(sdpa, spec, ids, m)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the gradients
    _run(eager, spec, ids).float().pow(2).mean().backward()
    _run(sdpa, spec, ids).float().pow(2).mean().backward()
    for (name, p), q in zip(eager.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", TINY, ids=_ids)
def test_flops_match_the_estimate(path):
    spec = load_spec(path)
    model = build_model(spec, attention_backend="eager").eval()
    ids = _tiny_inputs(spec, batch=1, seq=10)
    with FlopCounterMode(display=False) as counter:
        _run(model, spec, ids)
    assert counter.get_total_flops() == _estimate(spec, seq_len=10).flops.forward_per_token * 10


@pytest.mark.parametrize("path", [p for p in TINY if load_spec(p).architecture != "encoder-only"], ids=_ids)
def test_changing_a_future_token_never_changes_an_earlier_output(path):
    spec = load_spec(path)
    model = build_model(spec).eval()
    ids = _tiny_inputs(spec, batch=1, seq=20)
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % spec.vocab_size
    src = _tiny_inputs(spec, batch=1, seq=9, seed=1)  # encoder-decoder: the source stays fixed
    with torch.no_grad():
        if spec.architecture == "encoder-decoder":
            a, b = model(src, decoder_input_ids=ids), model(src, decoder_input_ids=changed)
        else:
            a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_encoder_sees_the_whole_sequence():
    spec = load_spec(ROOT / "specs" / "tiny" / "bert.yaml")
    model = build_model(spec).eval()
    ids = _tiny_inputs(spec, batch=1, seq=10)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % spec.vocab_size
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 0], model(changed)[:, 0])


@pytest.mark.parametrize("path", TINY, ids=_ids)
def test_padding_does_not_change_the_real_tokens(path):
    """Left padding for decoders, right padding for encoders: real tokens' outputs unchanged."""
    spec = load_spec(path)
    model = build_model(spec).eval()
    ids = _tiny_inputs(spec, batch=1, seq=8)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        if spec.architecture == "decoder-only":
            padded = torch.cat((pad, ids), 1)
            mask = torch.cat((torch.zeros_like(pad), torch.ones_like(ids)), 1)
            torch.testing.assert_close(model(padded, mask)[:, 3:], model(ids), rtol=1e-5, atol=1e-5)
        elif spec.architecture == "encoder-only":
            padded = torch.cat((ids, pad), 1)
            mask = torch.cat((torch.ones_like(ids), torch.zeros_like(pad)), 1)
            torch.testing.assert_close(model(padded, mask)[:, :8], model(ids), rtol=1e-5, atol=1e-5)
        else:
            tgt = ids[:, :5]
            padded = torch.cat((ids, pad), 1)
            mask = torch.cat((torch.ones_like(ids), torch.zeros_like(pad)), 1)
            torch.testing.assert_close(
                model(padded, mask, decoder_input_ids=tgt), model(ids, decoder_input_ids=tgt), rtol=1e-5, atol=1e-5
            )


def _tiny(**overrides):
    data = {
        "name": "t",
        "architecture": "decoder-only",
        "vocab_size": 50,
        "d_model": 32,
        "max_seq_len": 32,
        "decoder": {
            "n_layers": 4,
            "attention": {"n_heads": 4},
            "ffn": {"type": "glu", "hidden_dim": 64},
            "norm": {"type": "rmsnorm"},
        },
    }
    for key, value in overrides.items():
        data[key] = value
    return spec_model().model_validate(data)


def test_initialisation_follows_blocks_init():
    torch.manual_seed(0)
    spec = _tiny(
        d_model=256,
        vocab_size=2000,
        tie_embeddings=False,
        decoder={
            "n_layers": 8,
            "attention": {"n_heads": 4, "qkv_bias": True},
            "ffn": {"type": "mlp", "bias": True, "hidden_dim": 1024},
            "norm": {"type": "layernorm"},
        },
    )
    model = build_model(spec)
    layer = model.decoder.layers[0]
    assert abs(model.decoder.embedding.tokens.weight.std().item() - 0.02) < 1e-3
    assert abs(layer.attention.q_proj.weight.std().item() - 0.02) < 1e-3
    assert abs(layer.ffn.up_proj.weight.std().item() - 0.02) < 1e-3
    residual = 0.02 / math.sqrt(2 * 8)
    assert abs(layer.attention.out_proj.weight.std().item() - residual) < 2e-4
    assert abs(layer.ffn.down_proj.weight.std().item() - residual) < 2e-4
    assert (layer.attention.q_proj.bias == 0).all() and (layer.ffn.up_proj.bias == 0).all()
    assert (layer.attention_norm.weight == 1).all() and (layer.attention_norm.bias == 0).all()
    # seeded: the same seed builds the same weights
    torch.manual_seed(0)
    again = build_model(spec)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    # Gemma's unit offset starts at 0
    gemma = build_model(load_spec(ROOT / "specs" / "tiny" / "gemma2.yaml"))
    assert (gemma.decoder.layers[0].attention_norm.weight == 0).all()


def test_tied_and_shared_embeddings():
    tied = build_model(_tiny(tie_embeddings=True))
    assert tied.head.proj.weight is tied.decoder.embedding.tokens.weight
    untied = build_model(_tiny(tie_embeddings=False))
    assert untied.head.proj.weight is not untied.decoder.embedding.tokens.weight
    assert untied.n_params() - tied.n_params() == 50 * 32
    t5 = load_spec(ROOT / "specs" / "tiny" / "t5.yaml")
    shared = build_model(t5)
    assert shared.encoder.embedding is shared.decoder.embedding
    data = t5.model_dump(exclude={"extends"})
    data["share_encoder_decoder_embeddings"] = False
    separate_spec = spec_model().model_validate(data)
    separate = build_model(separate_spec)
    assert separate.encoder.embedding is not separate.decoder.embedding
    assert separate.head.proj.weight is separate.decoder.embedding.tokens.weight
    assert separate.n_params() == _estimate(separate_spec, seq_len=8).params.total


def test_heads_classification_and_none():
    bert = load_spec(ROOT / "specs" / "tiny" / "bert.yaml")
    data = bert.model_dump(exclude={"extends"})
    data["head"] = {"type": "classification", "n_classes": 3, "pooling": "mean", "pooler": True}
    spec = spec_model().model_validate(data)
    model = build_model(spec).eval()
    ids = _tiny_inputs(spec, batch=2, seq=6)
    assert model(ids).shape == (2, 3)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[:, 6:] = 0
    padded = torch.cat((ids, torch.zeros(2, 3, dtype=torch.long)), 1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, mask), model(ids), rtol=1e-5, atol=1e-5)
    data["head"] = {"type": "none"}
    hidden = build_model(spec_model().model_validate(data))(ids)
    assert hidden.shape == (2, 6, spec.d_model)


def test_token_type_ids_and_bad_input():
    spec = load_spec(ROOT / "specs" / "tiny" / "bert.yaml")
    model = build_model(spec).eval()
    ids = _tiny_inputs(spec, batch=1, seq=6)
    with torch.no_grad():
        zeros = model(ids, token_type_ids=torch.zeros_like(ids))
        torch.testing.assert_close(model(ids), zeros)  # type 0 by default
        assert not torch.allclose(model(ids, token_type_ids=torch.ones_like(ids)), zeros)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, torch.ones(1, 4))
    with pytest.raises(ValueError, match="token ids"):
        model(ids.float())
    llama = build_model(load_spec(ROOT / "specs" / "tiny" / "llama.yaml"))
    with pytest.raises(ValueError, match="segment"):
        llama(ids, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="attention_backend"):
        build_model(spec, attention_backend="flash")


def test_moe_aux_loss_is_collected():
    spec = load_spec(ROOT / "specs" / "tiny" / "mixtral.yaml")
    model = build_model(spec)
    assert model.aux_loss().item() == 0.0  # before any forward
    model(_tiny_inputs(spec))
    aux = model.aux_loss()
    assert aux.requires_grad and aux.item() > 0
    per_layer = [layer.ffn.aux_loss for layer in model.decoder.layers]
    torch.testing.assert_close(aux, sum(per_layer))


def test_dtype_and_per_layer_overrides():
    model = build_model(load_spec(ROOT / "specs" / "tiny" / "llama.yaml"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32  # restored
    assert model(_tiny_inputs(model.spec)).dtype == torch.bfloat16
    spec = _tiny(
        decoder={
            "n_layers": 4,
            "attention": {"n_heads": 4},
            "ffn": {"type": "glu", "hidden_dim": 64},
            "overrides": [
                {"layers": "1::2", "attention": {"sliding_window": 3}, "ffn": {"type": "mlp", "hidden_dim": 16}}
            ],
        }
    )
    hybrid = build_model(spec)
    windows = [layer.attention.sliding_window for layer in hybrid.decoder.layers]
    assert windows == [None, 3, None, 3]
    assert [type(layer.ffn).__name__ for layer in hybrid.decoder.layers] == ["GLU", "MLP", "GLU", "MLP"]
    assert hybrid.n_params() == _estimate(spec, seq_len=8).params.total


def test_triton_backend_matches_eager_on_cpu_interpreter():
    """The Triton kernels (under TRITON_INTERPRET on CPU) inside a whole model: GQA, a window,
    softcaps, sandwich norms."""
    spec = load_spec(ROOT / "specs" / "tiny" / "gemma2.yaml")
    torch.manual_seed(0)
    eager = build_model(spec, attention_backend="eager").eval()
    triton = build_model(spec, attention_backend="triton").eval()
    triton.load_state_dict(eager.state_dict())
    ids = _tiny_inputs(spec, batch=1, seq=20)  # past the 16-token window
    with torch.no_grad():
        torch.testing.assert_close(triton(ids), eager(ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", [p for p in TINY if p.stem in ("t5", "transformer")], ids=lambda p: p.stem)
def test_activation_checkpointing_gives_the_same_gradients(path):
    """Layers recomputed in the backward (relative bias shared across layers included) match."""
    from torch.utils.checkpoint import checkpoint

    model = build_model(load_spec(path), attention_backend="eager").train()
    src, tgt = torch.randint(0, 100, (2, 9)), torch.randint(0, 100, (2, 7))

    def grads():
        torch.manual_seed(1)
        model.zero_grad()
        model(src, decoder_input_ids=tgt).float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    for stack in model.stacks().values():
        for layer in stack.layers:
            layer.forward = lambda *a, _f=layer.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    recomputed = grads()
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], msg=name)
