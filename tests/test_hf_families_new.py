"""Hugging Face families qwen3, qwen3_moe, olmo2, phi3, gpt_neox and mpt: import from a random
tiny transformers model (logits and greedy tokens equal), the count, export through the family
itself and back (transformers loads it with the same logits; the spec and weights read back bit
for bit), cached decoding equal to recomputation, ``generate`` and ``pipeline("text-generation")``
on the exported folder with a tokenizer (the zoo's specs of these families:
``tests/test_hf_families_zoo.py``).

The random models and the comparisons are ``tests/test_hf.py``'s (its ``Case``, ``_randomize``,
``_batch``...); ``CASES`` here joins its table, so ``test_every_family_has_a_parity_case``
counts these families as covered.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_hf import VOCAB, Case, _batch, _greedy, _hf_model, _hf_params, _kept, _logits, _mpt_six_heads

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.assemble import build_model
from yamlformer.builder.hf import FAMILIES, from_hf, import_hf, load_weights, read_weights, to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
#: a character tokenizer of VOCAB ids (printable ASCII, then Latin-1 letters), so that every token
#: a model generates is text, for the exported folders' pipelines
CHARS = "".join(chr(c) for c in range(32, 127)) + "".join(chr(c) for c in range(0xC0, 0xC0 + VOCAB - 95))
NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


# --- the random tiny models ----------------------------------------------------------------


def _phi3():  # GQA, untied, no window
    return transformers.Phi3ForCausalLM(
        transformers.Phi3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **NO_TOKENS,
        )
    )


def _phi3_window():  # a sliding window, half the head dims rotating, head_dim != d / heads, tied
    return transformers.Phi3ForCausalLM(
        transformers.Phi3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=24,
            max_position_embeddings=64,
            sliding_window=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            **NO_TOKENS,
        )
    )


def _qwen3():  # GQA, head_dim != d / heads, tied, the second layer on a sliding window
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            rms_norm_eps=1e-5,
        )
    )


def _qwen3_bias():  # attention_bias on q, k, v and o; MHA; untied
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            attention_bias=True,
        )
    )


def _without_head_dim(folder: Path) -> None:
    """A config that leaves head_dim and num_key_value_heads to the class: Qwen3Config's 128 and
    32, not Llama's hidden_size / heads and num_attention_heads."""
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("head_dim") == 128 and config.pop("num_key_value_heads") == 32
    (folder / "config.json").write_text(json.dumps(config))


def _qwen3_moe(norm_topk_prob: bool, **kwargs):
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=norm_topk_prob,
            max_position_embeddings=64,
            **kwargs,
        )
    )


def _olmo2(**kwargs):  # GQA, untied
    return transformers.Olmo2ForCausalLM(
        transformers.Olmo2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            **NO_TOKENS,
            **kwargs,
        )
    )


def _gpt_neox(**kwargs):  # Pythia's layout: parallel residual, a quarter of each head rotating, biases
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            **NO_TOKENS,
            **kwargs,
        )
    )


def _neox_4x_config(folder: Path) -> None:
    """A config as Pythia's were published (transformers 4.x): rotary_pct and rotary_emb_base, no
    rope_parameters."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (folder / "config.json").write_text(json.dumps(config))


CASES = {
    "olmo2": Case(_olmo2, "causal"),
    "olmo2-bias-tied": Case(lambda: _olmo2(attention_bias=True, tie_word_embeddings=True), "causal"),
    "gpt_neox": Case(_gpt_neox, "causal"),
    # sequential layers, all of each head rotating at another base, no attention biases, tied, gelu_new
    "gpt_neox-sequential-full-rotary": Case(
        lambda: _gpt_neox(
            use_parallel_residual=False,
            attention_bias=False,
            tie_word_embeddings=True,
            hidden_act="gelu_new",
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
        ),
        "causal",
    ),
    "gpt_neox-4.x-config": Case(
        lambda: _gpt_neox(rope_parameters={"rope_theta": 300.0, "partial_rotary_factor": 0.5}),
        "causal",
        edit=_neox_4x_config,
    ),
    "mpt": Case(_mpt_six_heads, "causal"),
    # renormalised top-k probabilities, the middle layer dense; raw ones on every layer of a
    # 4-token window
    "qwen3_moe-renormalised-dense-middle": Case(lambda: _qwen3_moe(True, mlp_only_layers=[1]), "causal"),
    "qwen3_moe-raw-probabilities-window": Case(
        lambda: _qwen3_moe(False, use_sliding_window=True, sliding_window=4), "causal"
    ),
    "qwen3": Case(_qwen3, "causal"),
    "qwen3-bias-untied": Case(_qwen3_bias, "causal"),
    "qwen3-default-head-dim": Case(
        lambda: transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=1,
                num_attention_heads=32,
            )
        ),
        "causal",
        edit=_without_head_dim,
    ),
    "phi3": Case(_phi3, "causal"),
    "phi3-window-partial-rotary-tied": Case(_phi3_window, "causal"),
}


# --- import, export through the family, cached decoding, pipeline --------------------------


def import_case(cases: dict, name: str, tmp_path_factory):
    """The case's transformers model, and ours imported from its folder: (name, hf, auto, spec, ours, tmp)."""
    tmp = tmp_path_factory.mktemp(name)
    hf, auto = _hf_model(cases[name], tmp / "hf")
    spec_path, weights_path = import_hf(tmp / "hf", tmp / "ours")
    spec = load_spec(spec_path)
    ours = load_weights(build_model(spec), weights_path).eval()
    return name, hf, auto, spec, ours, tmp


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    return import_case(CASES, request.param, tmp_path_factory)


def test_import_matches_logits_greedy_tokens_and_count(imported):
    name, hf, _, spec, ours, _ = imported
    inputs = _batch("causal")
    theirs, mine = _logits(hf, inputs, ours=False), _logits(ours, inputs, ours=True)
    kept = _kept(inputs)
    assert theirs[kept].std() > 0.1, "logits too small for the tolerance to mean anything"
    diff = (mine[kept] - theirs[kept]).abs().max().item()
    assert diff < 1e-4, f"{name}: max |logit difference| {diff:.3g}"
    hf_tokens, our_tokens = _greedy(CASES[name], hf, ours, inputs)
    assert torch.equal(our_tokens, hf_tokens), f"{name}:\nours   {our_tokens}\ntheirs {hf_tokens}"
    assert estimate(spec).params.total == _hf_params(hf)


def test_export_through_the_family_loads_with_the_same_logits_and_reads_back(imported):
    name, hf, auto, spec, ours, tmp = imported
    family = hf.config.model_type
    assert to_hf(spec, ours, tmp / "export", family=family).model_type == family
    again = auto.from_pretrained(tmp / "export").eval()
    assert type(again) is type(hf)
    inputs = _batch("causal")
    assert torch.equal(_logits(again, inputs, ours=False), _logits(hf, inputs, ours=False))
    spec_again, state_again = from_hf(tmp / "export")
    original = read_weights(tmp / "ours" / "model.safetensors")
    assert set(state_again) == set(original) and all(torch.equal(state_again[k], original[k]) for k in original)
    assert spec_again.model_dump(exclude={"name"}) == spec.model_dump(exclude={"name"})


def test_cached_decoding_equals_recomputation(imported):
    """Greedy decoding past the prompt with the cache and without it, and each cached step's
    logits against the full forward's."""
    from yamlformer.blocks.generation import KVCache

    _, _, _, spec, ours, _ = imported
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    cached = ours.generate(ids[:, :5], max_new_tokens=12)
    assert torch.equal(cached, ours.generate(ids[:, :5], max_new_tokens=12, use_cache=False))
    with torch.no_grad():
        full = ours(ids)
        cache = KVCache.for_stack(ours.decoder, 2, 20, torch.float32, "cpu")
        parts = [ours(ids[:, :6], cache=cache)] + [ours(ids[:, i : i + 1], cache=cache) for i in range(6, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


def test_generate_and_pipeline_on_the_exported_folder(imported):
    """The folder written with a tokenizer: transformers' generate and pipeline decode greedily
    what ours does, as text and as tokens."""
    name, hf, auto, spec, ours, tmp = imported
    folder = tmp / "with-tokenizer"
    to_hf(spec, ours, folder, family=hf.config.model_type, tokenizer={"type": "char", "chars": CHARS})
    prompt = "def f(x):"
    ids = torch.tensor([[CHARS.index(c) for c in prompt]])
    mine = ours.generate(ids, max_new_tokens=8)
    theirs = auto.from_pretrained(folder).eval()
    hf_tokens = theirs.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, min_new_tokens=8
    )
    assert torch.equal(hf_tokens, mine), name
    pipe = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    out = pipe(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, return_tensors=True)
    assert list(out[0]["generated_token_ids"]) == mine[0].tolist()
    text = pipe(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text == "".join(CHARS[i] for i in mine[0].tolist())


# --- other on-disk layouts, refusals, and what export names --------------------------------


@pytest.mark.parametrize("name", ["qwen3_moe-renormalised-dense-middle", "qwen3_moe-raw-probabilities-window"])
def test_qwen3_moe_fused_expert_layout_imports_as_the_per_expert_one(name, tmp_path):
    """transformers 5.x holds the experts as 3-D gate_up_proj/down_proj; a state dict saved as it
    is reads as the same tensors as save_pretrained's per-expert checkpoint."""
    from safetensors.torch import save_file

    hf, _ = _hf_model(CASES[name], tmp_path / "per-expert")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per-expert" / "config.json").read_text())
    fused = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    _, per_expert = from_hf(tmp_path / "per-expert")
    _, from_fused = from_hf(tmp_path / "fused")
    assert set(per_expert) == set(from_fused) and all(torch.equal(per_expert[k], from_fused[k]) for k in per_expert)


def _saved_config(tmp_path: Path, name: str) -> Path:
    _hf_model(CASES[name], tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "name, change, needle",
    [
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                }
            },
            "rope_type 'longrope' is not supported",
        ),
        ("qwen3_moe-raw-probabilities-window", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen3_moe-raw-probabilities-window", {"mlp_only_layers": "all"}, "mlp_only_layers: expected a list"),
        ("gpt_neox", {"hidden_act": "gelu_fast"}, "activation 'gelu_fast' has no counterpart"),
        ("gpt_neox", {"rotary_pct": "a quarter"}, "rotary_pct: expected a finite number"),
        ("gpt_neox", {"use_parallel_residual": 1}, "use_parallel_residual: expected true or false"),
        ("qwen3_moe-raw-probabilities-window", {"decoder_sparse_step": 0}, "decoder_sparse_step: expected an integer"),
    ],
)
def test_a_config_without_an_exact_counterpart_is_refused_naming_the_key(name, change, needle, tmp_path):
    from yamlformer.builder.hf import HFError

    folder = _saved_config(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match=needle.replace("(", r"\(")) as refused:
        from_hf(folder)
    assert "\n" not in str(refused.value) and "config.json" in str(refused.value)


@pytest.mark.parametrize(
    "spec_name, family, change, needle",
    [
        (
            "tiny/neox",
            "gpt_neox",
            {"decoder.parallel_residual": "shared_norm"},
            "gpt_neox's parallel layer has two norms",
        ),
        (
            "tiny/neox",
            "gpt_neox",
            {"decoder.attention.n_kv_heads": 2},
            "attention.n_kv_heads is 2 in the spec; gpt_neox would make it 4",
        ),
        (
            "tiny/olmo2",
            "olmo2",
            {"decoder.attention.qk_norm.over": "head"},
            "qk_norm.over is 'head' in the spec; olmo2 would make it 'projection'",
        ),
        (
            "tiny/olmo2",
            "olmo2",
            {"decoder.norm.placement": "pre"},
            "norm.placement is 'pre' in the spec; olmo2 would make it 'post_sublayer'",
        ),
        (
            "tiny/qwen3",
            "qwen3",
            {"decoder.attention.qk_norm.eps": 1e-5},
            "qk_norm.eps is 1e-05 in the spec; qwen3 would make it 1e-06",
        ),
        (
            "tiny/qwen3",
            "qwen3",
            {"decoder.attention.qk_norm": None},
            "attention.qk_norm is None in the spec; qwen3 would make it",
        ),
        (
            "tiny/qwen3-moe",
            "qwen3_moe",
            {"decoder.ffn": {"type": "glu", "hidden_dim": 32}},
            "no layer's ffn is deepseek_moe",
        ),
        ("tiny/phi3", "phi3", {"decoder.ffn.bias": True}, "ffn.bias is True in the spec; phi3 would make it False"),
    ],
)
def test_export_names_what_the_family_cannot_express(spec_name, family, change, needle):
    from yamlformer.builder.hf import fit, validate

    data = load_spec(spec_name).model_dump(mode="json")
    for dotted, value in change.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    config, reasons = fit(FAMILIES[family], validate(data))
    assert config is None and any(needle in reason for reason in reasons), reasons


def test_the_export_line_names_each_family_before_training(capsys):
    """builder describe says which family each zoo spec is written as; Phi-3-mini computes what
    Mistral does, which export tries first (``--family phi3`` writes Phi3ForCausalLM)."""
    from yamlformer.builder.cli import main

    for name, family in [
        ("qwen3-0.6b", "qwen3 (Qwen3ForCausalLM)"),
        ("qwen3-30b-a3b", "qwen3_moe (Qwen3MoeForCausalLM)"),
        ("olmo2-7b", "olmo2 (Olmo2ForCausalLM)"),
        ("pythia-160m", "gpt_neox (GPTNeoXForCausalLM)"),
        ("phi3-mini", "mistral (MistralForCausalLM)"),
    ]:
        assert main(["describe", name]) == 0
        assert (
            capsys.readouterr().out.strip().splitlines()[-1] == f"export: Hugging Face {family}, by builder export-hf"
        )


@pytest.mark.parametrize(
    "family, minimal",
    [
        ("qwen3", {"num_attention_heads": 32}),
        ("qwen3_moe", {"num_attention_heads": 8}),
        ("olmo2", {"num_attention_heads": 4}),
        ("phi3", {"num_attention_heads": 4}),
        ("gpt_neox", {"num_attention_heads": 4}),
    ],
)
def test_a_key_a_config_leaves_out_reads_as_its_config_class_default(family, minimal):
    """A config.json with only the sizes reads as the same spec as transformers' config class
    with every default filled in (its to_dict)."""
    from yamlformer.builder.hf import config_to_spec, validate
    from yamlformer.builder.hf.writer import _semantic

    minimal = {
        "model_type": family,
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        **minimal,
    }
    full = transformers.AutoConfig.for_model(**minimal).to_dict()
    assert _semantic(validate(config_to_spec(minimal))) == _semantic(validate(config_to_spec(full)))
