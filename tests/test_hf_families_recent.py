"""Hugging Face families gemma3_text, gpt_oss and llama4_text.

The checks are ``tests/test_hf_families_new.py``'s and ``tests/test_hf_families_zoo.py``'s, run
here on this file's random tiny models and zoo tables (each test below hands its entry to the one
there): import (logits and greedy tokens equal to transformers', the count), export through the
family and back, cached decoding equal to recomputation, ``generate`` and
``pipeline("text-generation")`` on the exported folder, each tiny zoo spec exported with
transformers' logits, each full zoo spec read from its published config and counted as transformers
builds it on meta. What is particular to a family follows: both of Gemma 3's RoPE bases at work,
GPT-OSS's refusals, Llama 4's config lists.
``CASES`` joins ``tests/test_hf.py``'s coverage test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import test_hf_families_new as generic
import test_hf_families_zoo as zoo
from test_hf import VOCAB, Case, _batch, _kept, _logits, _randomize

from yamlformer.builder.assemble import build_model
from yamlformer.builder.hf import FAMILIES, HFError, fit, from_hf, load_weights, to_hf, validate
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
NO_TOKENS = generic.NO_TOKENS


# --- the random tiny models ----------------------------------------------------------------


def _gemma3():
    """Five local layers (a 3-token window, base 50) to one global (base 5000 with linear
    scaling, as Gemma 3 4B and up scale theirs), query_pre_attn_scalar != head_dim, GQA."""
    return transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=3,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            },
            **NO_TOKENS,
        )
    )


def _gemma3_unit_norms(folder: Path) -> None:
    """Gemma's norms scale by (1 + w): the unit-scale norm weights every case draws, made offsets
    (w - 1), so six sandwiched layers keep the logits O(1) and float32's rounding far below the
    cached-decoding tolerance."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors = {name: t - 1 if "norm" in name else t for name, t in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _gemma3_as_4x(folder: Path) -> None:
    """The same model as a transformers 4.x config spells it (the Hub's gemma-3-1b has these keys):
    sliding_window_pattern instead of layer_types, rope_theta and rope_local_base_freq, the
    global layers' scaling in rope_scaling."""
    _gemma3_unit_norms(folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    assert config.pop("layer_types") == ["sliding_attention"] * 5 + ["full_attention"]
    config.update(
        sliding_window_pattern=6,
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    (folder / "config.json").write_text(json.dumps(config))


def _gpt_oss():
    """Banded (3 tokens), full, banded; 4 experts, 2 per token, the clamp at 1.5 so that it bites on
    unit-scale weights; YaRN with fractional ramp ends."""
    return transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
                "rope_theta": 150000.0,
            },
            **NO_TOKENS,
        )
    )


def _llama4():
    """RoPE layers 0-2 in 3-token chunks with the L2 QK-norm, NoPE layer 3 with temperature tuning
    every 2 positions; MoE on layers 1 and 3, dense 0 and 2; biased attention; Llama 3 scaling."""
    return transformers.Llama4ForCausalLM(
        transformers.Llama4TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=24,
            intermediate_size_mlp=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=3,
            floor_scale=2,
            attn_scale=0.5,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 2.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
            **NO_TOKENS,
        )
    )


CASES = {
    "gemma3": Case(_gemma3, "causal", edit=_gemma3_unit_norms),
    "gemma3-4.x-config": Case(_gemma3, "causal", edit=_gemma3_as_4x),
    "gpt_oss": Case(_gpt_oss, "causal"),
    "llama4": Case(_llama4, "causal"),
}


# --- the checks of tests/test_hf_families_new.py, on these cases ----------------------------


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    return generic.import_case(CASES, request.param, tmp_path_factory)


def test_import_matches_logits_greedy_tokens_and_count(imported, monkeypatch):
    monkeypatch.setitem(generic.CASES, imported[0], CASES[imported[0]])
    generic.test_import_matches_logits_greedy_tokens_and_count(imported)


def test_export_through_the_family_loads_with_the_same_logits_and_reads_back(imported):
    generic.test_export_through_the_family_loads_with_the_same_logits_and_reads_back(imported)


def test_cached_decoding_equals_recomputation(imported):
    generic.test_cached_decoding_equals_recomputation(imported)


def test_generate_and_pipeline_on_the_exported_folder(imported):
    generic.test_generate_and_pipeline_on_the_exported_folder(imported)


#: tiny zoo spec -> the family it is written as
TINY = {"gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "llama4": "llama4_text"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_zoo_tiny_spec_exports_as_its_family_with_the_same_logits(name, tmp_path, monkeypatch):
    monkeypatch.setitem(zoo.TINY, name, TINY[name])
    zoo.test_zoo_tiny_spec_exports_as_its_family_with_the_same_logits(name, tmp_path)


_GPT_OSS_20B = {  # openai/gpt-oss-20b (its experts' MXFP4 quantization_config left out)
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

#: full zoo spec -> (family, the published config.json's architecture keys, the count)
PUBLISHED = {
    # google/gemma-3-1b-pt
    "gemma3-1b": (
        "gemma3_text",
        {
            "vocab_size": 262144,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 32768,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "attention_bias": False,
        },
        999_885_952,
    ),
    "gpt-oss-20b": ("gpt_oss", _GPT_OSS_20B, 20_914_757_184),
    # openai/gpt-oss-120b
    "gpt-oss-120b": (
        "gpt_oss",
        {
            **_GPT_OSS_20B,
            "num_hidden_layers": 36,
            "num_local_experts": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
        },
        116_829_156_672,
    ),
    # meta-llama/Llama-4-Scout-17B-16E, its text_config
    "llama4-scout": (
        "llama4_text",
        {
            "vocab_size": 202048,
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(48)],
            "attention_chunk_size": 8192,
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 8192,
            "attn_scale": 0.1,
            "attention_bias": False,
            "max_position_embeddings": 10485760,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        },
        107_769_861_120,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_zoo_spec_counts_what_transformers_builds_on_meta_from_the_published_config(name, monkeypatch):
    monkeypatch.setitem(zoo.PUBLISHED, name, PUBLISHED[name])
    zoo.test_zoo_spec_counts_what_transformers_builds_on_meta_from_the_published_config(name)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("imported", ["gemma3", "gpt_oss", "llama4"], indirect=True)
def test_every_attention_backend_computes_transformers_logits(imported, backend):
    """The imported weights on the SDPA path and the Triton kernels (sinks, chunks, windows,
    per-layer bases and NoPE layers inside them; the CPU interpreter here) give transformers'
    logits as the eager path does."""
    _, hf, _, spec, ours, _ = imported
    model = load_weights(build_model(spec, attention_backend=backend), ours.state_dict()).eval()
    inputs = _batch("causal")
    kept = _kept(inputs)
    diff = (_logits(model, inputs, ours=True) - _logits(hf, inputs, ours=False))[kept].abs().max().item()
    assert diff < 1e-4, f"{backend}: max |logit difference| {diff:.3g}"


# --- what is particular to a family ----------------------------------------------------------


@pytest.mark.parametrize("imported", ["gemma3", "gemma3-4.x-config"], indirect=True)
def test_gemma3_local_layers_rotate_on_their_own_base_and_global_ones_scaled(imported):
    """Imported Gemma 3 (either spelling): base 50 on the five local layers, 5000 with linear
    scaling on the global one; the local layers on the global base move the logits off."""
    _, hf, _, spec, ours, _ = imported
    layers = [spec.decoder.layer(i).attention for i in range(6)]
    assert [(a.sliding_window, a.rope_theta) for a in layers] == [(3, 50.0)] * 5 + [(None, None)]
    assert spec.position.theta == 5000.0 and spec.position.scaling.type == "linear"
    assert all(a.qk_norm.unit_offset and a.qk_norm.over == "head" for a in layers)
    data = spec.model_dump(mode="json")
    data["decoder"]["attention"]["rope_theta"] = None
    same_base = load_weights(build_model(validate(data)), ours.state_dict()).eval()
    inputs = _batch("causal")
    kept = _kept(inputs)
    moved = (_logits(same_base, inputs, ours=True) - _logits(hf, inputs, ours=False))[kept].abs().max().item()
    assert moved > 1e-2


def test_gemma3_attention_softcap_is_refused_as_transformers_ignores_it(tmp_path):
    """Gemma3TextConfig keeps attn_logit_softcapping, but Gemma3Attention never passes it on:
    a config that sets it is refused, and a spec with attention.softcap is no gemma3_text."""
    config = _exported_tiny("gemma3", tmp_path / "g3")
    assert config["attn_logit_softcapping"] is None and len(config["layer_types"]) == 6
    _rewrite(tmp_path / "g3", attn_logit_softcapping=50.0)
    with pytest.raises(HFError, match=r"config\.json: gemma3_text: attn_logit_softcapping is set, .* ignores it"):
        from_hf(tmp_path / "g3")
    spec = load_spec(REPO / "specs" / "tiny" / "gemma3.yaml", overrides={"decoder.attention.softcap": 50.0})
    config, reasons = fit(FAMILIES["gemma3_text"], spec)
    assert config is None and "attn_logit_softcapping is set" in reasons[0]


def _exported_tiny(name: str, folder: Path):
    spec = load_spec(REPO / "specs" / "tiny" / f"{name}.yaml")
    to_hf(spec, build_model(spec), folder)
    return json.loads((folder / "config.json").read_text())


def _rewrite(folder: Path, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


def test_gpt_oss_refuses_quantized_experts_and_a_spec_without_its_clamp(tmp_path):
    """The released checkpoints' MXFP4 experts are refused with what to do; a spec whose experts
    are not clamped is not GPT-OSS, and export names the field."""
    config = _exported_tiny("gpt-oss", tmp_path / "oss")
    assert config["rope_parameters"]["truncate"] is False and config["swiglu_limit"] == 7.0
    _rewrite(tmp_path / "oss", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(HFError, match=r"config\.json: gpt_oss: quantized experts .*Mxfp4Config\(dequantize=True\)"):
        from_hf(tmp_path / "oss")
    data = load_spec(REPO / "specs" / "tiny" / "gpt-oss.yaml").model_dump(mode="json")
    data["decoder"]["ffn"]["clamp"] = None
    assert fit(FAMILIES["gpt_oss"], validate(data)) == (
        None,
        ["ffn.clamp is null; gpt_oss's experts always clamp their SwiGLU (swiglu_alpha, _limit)"],
    )


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers: 3 entries for num_hidden_layers 4"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers: expected a list of 0 and 1"),
        ({"moe_layers": [0, 9]}, "moe_layers: expected a list of layer indices from 0 to 3"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types has 3 entries for num_hidden_layers 4"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer types ['sliding_attention'] are not supported"),
        ({"attn_temperature_tuning": "yes"}, "attn_temperature_tuning: expected true, false or an integer"),
        ({"floor_scale": 0}, "floor_scale: expected an integer from 1"),
    ],
)
def test_llama4_config_lists_of_the_wrong_kind_name_their_key(tmp_path, values, needle):
    _exported_tiny("llama4", tmp_path / "l4")
    _rewrite(tmp_path / "l4", **values)
    with pytest.raises(HFError) as error:
        from_hf(tmp_path / "l4")
    assert str(error.value).startswith(str(tmp_path / "l4" / "config.json")) and needle in str(error.value)


def test_llama4_older_configs_read_as_transformers_reads_them(tmp_path):
    """An integer attn_temperature_tuning (4.x configs) is its truth; without no_rope_layers,
    layer_types and moe_layers, the intervals decide (every 4th NoPE, MoE every step)."""
    config = _exported_tiny("llama4", tmp_path / "l4")
    spec, _ = from_hf(tmp_path / "l4")
    for key in ("no_rope_layers", "layer_types", "moe_layers"):
        config.pop(key)
    (tmp_path / "l4" / "config.json").write_text(json.dumps({**config, "attn_temperature_tuning": 4}))
    again, _ = from_hf(tmp_path / "l4")
    assert again.model_dump(exclude={"name"}) == spec.model_dump(exclude={"name"})
    assert [again.decoder.layer(i).attention.rope for i in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("name, family", sorted(TINY.items()))
def test_a_partial_rotation_is_refused_naming_why(name, family):
    """transformers' Gemma 3, GPT-OSS and Llama 4 rotate whole heads whatever
    partial_rotary_factor says: a spec rotating half of each is none of them."""
    spec = load_spec(REPO / "specs" / "tiny" / f"{name}.yaml", overrides={"position.rotary_fraction": 0.5})
    assert fit(FAMILIES[family], spec) == (
        None,
        [f"{family}: partial_rotary_factor 0.5: transformers' {family} rotates the whole head"],
    )


def test_llama4_without_moe_layers_round_trips(tmp_path):
    """Every layer dense (moe_layers empty, intermediate_size_mlp their width): written, read back
    as the same layers; transformers computes our logits from it."""
    spec = load_spec(
        REPO / "specs" / "tiny" / "llama4.yaml",
        overrides={"decoder.ffn": {"type": "glu", "activation": "silu", "hidden_dim": 96}},
    )
    config, reasons = fit(FAMILIES["llama4_text"], spec)
    assert reasons == [] and config["moe_layers"] == [] and config["intermediate_size_mlp"] == 96
    torch.manual_seed(0)
    ours = build_model(spec).eval()
    _randomize(ours)
    to_hf(spec, ours, tmp_path / "out")
    back, _ = from_hf(tmp_path / "out")
    assert [back.decoder.layer(i) for i in range(4)] == [spec.decoder.layer(i) for i in range(4)]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = _batch("causal")
    kept = _kept(inputs)
    assert (_logits(ours, inputs, ours=True) - _logits(theirs, inputs, ours=False))[kept].abs().max().item() < 1e-4


_SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
}


@pytest.mark.parametrize(
    "family, more",
    [("gemma3_text", {}), ("gpt_oss", {}), ("llama4_text", {"intermediate_size_mlp": 40})],
)
def test_a_config_that_leaves_keys_out_reads_as_its_config_class_defaults_them(family, more):
    """Only the sizes given: head_dim, key/value heads, experts and the rest are the config
    class's defaults (Gemma 3: head_dim 256, 4 key/value heads; GPT-OSS: 128 experts, head_dim
    64, 8 key/value heads; Llama 4: 16 experts, head_dim 128, 8 key/value heads), so the counts
    agree with transformers' model."""
    from yamlformer.builder.analysis.estimates import estimate
    from yamlformer.builder.hf import config_to_spec

    given = {**_SIZES, **more}
    spec = validate({"name": family, **config_to_spec({"model_type": family, **given})})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **given))
    assert estimate(spec).params.total == sum(p.numel() for p in model.parameters())
