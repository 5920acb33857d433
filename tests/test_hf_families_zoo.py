"""The zoo's specs of the Hugging Face families of ``tests/test_hf_families_new.py``: each tiny
spec exported as its family with transformers' logits, and each full spec counted as
transformers builds it on the meta device from the published config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_hf import _kept, _logits, _randomize

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.assemble import build_model
from yamlformer.builder.hf import FAMILIES, to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]

#: tiny zoo spec -> the family it is written as
TINY = {
    "gemma2": "gemma2",
    "phi3": "phi3",
    "qwen3": "qwen3",
    "qwen3-moe": "qwen3_moe",
    "olmo2": "olmo2",
    "neox": "gpt_neox",
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_zoo_tiny_spec_exports_as_its_family_with_the_same_logits(name, tmp_path):
    spec = load_spec(REPO / "specs" / "tiny" / f"{name}.yaml")
    torch.manual_seed(0)
    ours = build_model(spec).eval()
    _randomize(ours)
    assert to_hf(spec, ours, tmp_path / "out", family=TINY[name]).model_type == TINY[name]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = {"input_ids": torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][1, 20:] = 0
    mine, hf_logits = _logits(ours, inputs, ours=True), _logits(theirs, inputs, ours=False)
    kept = _kept(inputs)
    assert hf_logits[kept].std() > 0.1
    assert (mine[kept] - hf_logits[kept]).abs().max().item() < 1e-4


#: full zoo spec -> (family, the published config.json's architecture keys, the count)
_QWEN3 = {
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}
PUBLISHED = {
    # allenai/OLMo-2-1124-7B
    "olmo2-7b": (
        "olmo2",
        {
            "vocab_size": 100352,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        },
        7_298_617_344,
    ),
    # EleutherAI/pythia-160m (a transformers 4.x config: rotary_pct and rotary_emb_base)
    "pythia-160m": (
        "gpt_neox",
        {
            "vocab_size": 50304,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 2048,
            "rotary_pct": 0.25,
            "rotary_emb_base": 10000,
            "use_parallel_residual": True,
            "layer_norm_eps": 1e-5,
            "hidden_act": "gelu",
            "tie_word_embeddings": False,
        },
        162_322_944,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": (
        "qwen3",
        {
            **_QWEN3,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "max_window_layers": 28,
            "tie_word_embeddings": True,
        },
        596_049_920,
    ),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": (
        "qwen3_moe",
        {
            **_QWEN3,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
        },
        30_532_122_624,
    ),
    # microsoft/Phi-3-mini-4k-instruct
    "phi3-mini": (
        "phi3",
        {
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        },
        3_821_079_552,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_zoo_spec_counts_what_transformers_builds_on_meta_from_the_published_config(name):
    """The spec imports from the published config, and both it and transformers' model built on
    meta from that config count the header's parameters."""
    from yamlformer.builder.hf import config_to_spec, validate
    from yamlformer.builder.hf.writer import _semantic  # what a spec means, layer by layer, defaults resolved

    family, published, count = PUBLISHED[name]
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    imported = validate({"name": name, **config_to_spec({"model_type": family, **published})})
    assert _semantic(imported) == _semantic(spec)
    hf_config = transformers.AutoConfig.for_model(family, **published, pad_token_id=None)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == estimate(spec).params.total == count
    assert FAMILIES[family].to_config(spec)  # and export can write it
