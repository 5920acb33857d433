"""Every registered block counts what it builds: parameters == numel, FLOPs == FlopCounterMode.

Each config class in ``blocks/configs`` lists ``examples``; this file walks the whole registry,
builds each example with ``yamlformer.blocks.build.build_block`` (the eager attention backend) and sets the
config's own ``params``/``flops`` against the module, at two sequence lengths. Position blocks
and architectures act inside a model, so their FLOPs are checked on tiny whole models. A block
registered without examples fails the meta-test: nothing lands uncounted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks import registry
from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.build import Dims, build_block
from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.report import actual_params
from yamlformer.builder.assemble import build_model
from yamlformer.builder.spec.schema import spec_model

D_MODEL, VOCAB, MAX_SEQ, N_HEADS, HEAD_DIM = 32, 50, 16, 4, 8
DIMS = Dims(d_model=D_MODEL, vocab_size=VOCAB, max_seq_len=MAX_SEQ)
STACK_DIMS = Dims(d_model=D_MODEL, vocab_size=VOCAB, max_seq_len=MAX_SEQ, n_heads=N_HEADS, rotary_head_dim=HEAD_DIM)
LENGTHS = (5, 11)


def _cases(kind: str):
    for name, cls in sorted(registry.configs(kind).items()):
        for i, example in enumerate(cls.__dict__.get("examples", [])):
            yield pytest.param(cls, example, id=f"{name}-{i}")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def _tiny_spec(architecture: str = "decoder-only", position=None, head=None, **top):
    stack = {
        "n_layers": 2,
        "attention": {"n_heads": N_HEADS},
        "ffn": {"type": "glu", "hidden_dim": 40},
        "norm": {"type": "rmsnorm"},
    }
    spec = {
        "name": f"tiny-{architecture}",
        "architecture": architecture,
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "max_seq_len": MAX_SEQ,
        "position": position or {"type": "rope"},
        "head": head or {"type": "lm"},
        **top,
    }
    for name in registry.config_class("architecture", architecture).stacks:
        spec[name] = stack
    return spec_model().model_validate(spec)


def _model_flops(spec, seq: int, src: int | None = None) -> int:
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager").eval()
    ids = torch.randint(0, spec.vocab_size, (1, seq))
    if spec.architecture == "encoder-decoder":
        src_ids = torch.randint(0, spec.vocab_size, (1, src or seq))
        return _flops(lambda: model(src_ids, decoder_input_ids=ids))
    return _flops(lambda: model(ids))


def test_every_registered_block_has_examples():
    missing = [
        f"{kind}/{name} ({cls.__module__}.{cls.__qualname__})"
        for kind in registry.KINDS
        for name, cls in registry.configs(kind).items()
        if not cls.__dict__.get("examples")
    ]
    assert not missing, "registered blocks without `examples` to count them: " + ", ".join(missing)


@pytest.mark.parametrize("cls, example", list(_cases("attention")))
@pytest.mark.parametrize("causal", [True, False])
def test_attention(cls, example, causal):
    config = cls.model_validate(example)
    module = build_block(config, DIMS, causal=causal, cross=False, backend="eager").eval()
    assert _numel(module) == config.params(D_MODEL)
    for seq in LENGTHS:
        x = torch.randn(1, seq, D_MODEL)
        inputs = AttentionInputs(0, seq, positions=torch.arange(seq)[None])
        assert _flops(lambda: module(x, inputs)) == config.flops(D_MODEL, seq, seq)
        # a mask-aware kernel visits the (query, key) pairs the mask keeps, no more
        assert (
            config.kernel_flops(D_MODEL, seq, seq, causal=False) == config.flops(D_MODEL, seq, seq)
            or config.window() is not None
            or config.chunk() is not None
        )
        pairs = config.visible_pairs(seq, seq, causal)
        assert config.kernel_flops(D_MODEL, seq, seq, causal) == config.flops(D_MODEL, seq, seq) - (
            seq * seq - pairs
        ) * config.pair_flops(D_MODEL)


@pytest.mark.parametrize("cls, example", list(_cases("attention")))
def test_cross_attention(cls, example):
    config = cls.model_validate(example).for_cross_attention()
    if config.problems(D_MODEL, cross=True):  # a block that cannot cross-attend says so (mla)
        with pytest.raises(ValueError):
            build_block(config, DIMS, cross=True, backend="eager")
        return
    module = build_block(config, DIMS, cross=True, backend="eager").eval()
    assert _numel(module) == config.params(D_MODEL)
    for seq, src in ((LENGTHS[0], LENGTHS[1]), (LENGTHS[1], LENGTHS[0])):
        x, memory = torch.randn(1, seq, D_MODEL), torch.randn(1, src, D_MODEL)
        flops = _flops(lambda: module(x, AttentionInputs(0, seq), memory=memory))
        assert flops == config.flops(D_MODEL, seq, src)


@pytest.mark.parametrize("cls, example", list(_cases("ffn")))
def test_ffn(cls, example):
    config = cls.model_validate(example)
    module = build_block(config, DIMS).eval()
    assert _numel(module) == config.params(D_MODEL)
    assert config.active_params(D_MODEL) <= config.params(D_MODEL)
    torch.manual_seed(0)
    for seq in LENGTHS:
        x = torch.randn(1, seq, D_MODEL)
        assert _flops(lambda: module(x)) == config.flops(D_MODEL, seq)


@pytest.mark.parametrize("cls, example", list(_cases("norm")))
def test_norm(cls, example):
    config = cls.model_validate(example)
    module = build_block(config, DIMS)
    assert _numel(module) == config.params(D_MODEL)
    assert _flops(lambda: module(torch.randn(1, LENGTHS[0], D_MODEL))) == 0


@pytest.mark.parametrize("cls, example", list(_cases("head")))
@pytest.mark.parametrize("tied", [False, True])
def test_head(cls, example, tied):
    """Counted on a forward without a cache: the head gets its context (yamlformer.blocks.heads.HeadContext)."""
    from yamlformer.blocks.embeddings import Embeddings
    from yamlformer.blocks.heads import HeadContext

    config = cls.model_validate(example)
    embeddings = Embeddings(VOCAB, D_MODEL)
    embedding = embeddings.tokens if tied and cls.projects_to_vocab else None
    module = build_block(config, DIMS, tied_embedding=embedding, backend="eager").eval()
    own = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    numel = sum(p.numel() for p in module.parameters() if id(p) not in own)
    assert numel == config.params(D_MODEL, VOCAB, embedding is not None)
    # a part only training runs (multi-token prediction) is the submodule it is named after
    for part, (n, _) in config.auxiliary(D_MODEL, VOCAB, embedding is not None, LENGTHS[0]).items():
        assert sum(p.numel() for p in getattr(module, part).parameters() if id(p) not in own) == n
    for seq in LENGTHS:
        hidden = torch.randn(1, seq, D_MODEL)
        ids = torch.randint(0, VOCAB, (1, seq))
        context = HeadContext(ids, embeddings, AttentionInputs(0, seq, positions=torch.arange(seq)[None]))
        assert _flops(lambda: module(hidden, None, context)) == config.flops(D_MODEL, VOCAB, seq)


@pytest.mark.parametrize("cls, example", list(_cases("position")))
def test_position(cls, example):
    config = cls.model_validate(example)
    module = build_block(config, STACK_DIMS, causal=True)
    assert _numel(module) == config.params(D_MODEL, N_HEADS, MAX_SEQ)
    # positions act inside attention or the embeddings: count them in a whole tiny model
    spec = _tiny_spec(position={"type": cls.model_fields["type"].default, **example})
    assert actual_params(build_model(spec, device="meta")) == _nonzero(estimate(spec).params.by_component)
    for seq in LENGTHS:
        assert _model_flops(spec, seq) == estimate(spec, seq_len=seq).flops.forward_per_sequence


@pytest.mark.parametrize("cls, example", list(_cases("architecture")))
def test_architecture(cls, example):
    name = cls.model_fields["type"].default
    spec = _tiny_spec(name, head={"type": "mlm"} if name == "encoder-only" else None)
    model = build_model(spec, device="meta")
    assert actual_params(model) == _nonzero(estimate(spec).params.by_component)
    for seq in LENGTHS:
        src = seq + 3 if name == "encoder-decoder" else None
        est = estimate(spec, seq_len=seq, src_len=src)
        assert _model_flops(spec, seq, src) == est.flops.forward_per_sequence


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {key: n for key, n in counts.items() if n}
