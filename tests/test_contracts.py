"""Every registered block honours its contract (``yamlformer.blocks.configs.base``), found by walking the
registry: a block registered later (a plugin's; ``BUILDER_PLUGINS=module pytest ...``) is covered
without editing this file. Counts and FLOPs: ``tests/test_block_counts.py``.

* each example of each block validates inside a spec and the JSON Schema accepts that spec;
* each attention block, and each position acting in attention, decodes with the KV cache its
  config declares exactly as repeated full forward passes do, and ``describe``'s KV-cache bytes
  are what ``generate`` allocates.
"""

from __future__ import annotations

import pytest
import torch

from yamlformer.blocks import registry
from yamlformer.blocks.cache import KVCache
from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.assemble import build_model
from yamlformer.builder.spec.schema import ModelSpec

D_MODEL, VOCAB, MAX_SEQ = 32, 64, 32
WHERE = {
    "attention": ("decoder", "attention"),
    "ffn": ("decoder", "ffn"),
    "norm": ("decoder", "norm"),
    "position": ("position",),
    "head": ("head",),
}


def _cases(kind: str, where=None):
    for name, cls in sorted(registry.configs(kind).items()):
        if where is None or cls.acts_on == where:
            for i, example in enumerate(cls.__dict__.get("examples", [])):
                yield pytest.param({"type": name, **example}, id=f"{name}-{i}")


def _spec_data(**blocks) -> dict:
    data = {
        "name": "contract",
        "architecture": "decoder-only",
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "max_seq_len": MAX_SEQ,
        "position": {"type": "rope"},
        "decoder": {
            "n_layers": 2,
            "attention": {"n_heads": 4, "n_kv_heads": 2},
            "ffn": {"type": "glu", "hidden_dim": 48},
            "norm": {"type": "rmsnorm"},
        },
    }
    for kind, block in blocks.items():
        *parents, last = WHERE[kind]
        node = data
        for part in parents:
            node = node[part]
        node[last] = block
    return data


@pytest.fixture(scope="module")
def json_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from yamlformer.builder.cli.schema import spec_json_schema

    return jsonschema.Draft202012Validator(spec_json_schema())


@pytest.mark.parametrize(
    "kind, block",
    [pytest.param(kind, case.values[0], id=f"{kind}-{case.id}") for kind in sorted(WHERE) for case in _cases(kind)],
)
def test_every_block_joins_a_spec_and_the_json_schema(kind, block, json_schema):
    data = _spec_data(**{kind: block})
    spec = ModelSpec.model_validate(data)
    assert isinstance(spec, ModelSpec) and spec.name == "contract"
    errors = [e.message for e in json_schema.iter_errors(data)]
    assert not errors, errors[:3]


def _decoder(**blocks):
    spec = ModelSpec.model_validate(_spec_data(**blocks))
    torch.manual_seed(0)
    return spec, build_model(spec, attention_backend="eager").eval()


def _check_decoding(spec, model):
    """Cached greedy == recomputed greedy; cached logits step by step == the full pass; the
    cache holds exactly the bytes the estimate declares."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=gen)
    new = 12
    cached = model.generate(prompt, max_new_tokens=new)
    assert model.last_cache_nbytes == estimate(spec, seq_len=5 + new, batch=2, dtype="fp32").memory.kv_cache
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=new, use_cache=False))
    seq = torch.randint(0, VOCAB, (2, 16), generator=gen)
    with torch.no_grad():
        full = model(seq)
        cache = KVCache.for_stack(model.decoder, 2, 16, torch.float32, "cpu")
        parts = [model(seq[:, :6], cache=cache)] + [model(seq[:, i : i + 1], cache=cache) for i in range(6, 16)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)
    assert cache.nbytes() == estimate(spec, seq_len=16, batch=2, dtype="fp32").memory.kv_cache


@pytest.mark.parametrize("attention", list(_cases("attention")))
def test_attention_decodes_with_its_cache_as_full_recomputation(attention):
    _check_decoding(*_decoder(attention=attention))


@pytest.mark.parametrize("position", list(_cases("position", where="attention")))
def test_attention_positions_decode_with_the_cache_as_full_recomputation(position):
    _check_decoding(*_decoder(position=position))


def test_register_refuses_a_block_that_breaks_its_contract():
    from typing import Literal

    from yamlformer.blocks.configs.base import NormBlock
    from yamlformer.blocks.configs.norm import RMSNormConfig
    from yamlformer.blocks.registry import RegistryError, register

    class HalfNorm(NormBlock):
        type: Literal["half"] = "half"

        def params(self, d_model: int) -> int:
            return d_model

    with pytest.raises(RegistryError, match="leaves param_shapes, saved_bytes of NormBlock unimplemented"):
        register("norm", "nowhere:HalfNorm")(HalfNorm)
    with pytest.raises(RegistryError, match="must subclass yamlformer.blocks.configs.base_attention.AttentionBlock"):
        register("attention", "nowhere:RMSNorm")(RMSNormConfig)
    assert "half" not in registry.configs("norm")
