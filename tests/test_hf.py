"""Hugging Face parity: import a local model folder, match its logits and greedy tokens, export back.

Every model is built here from a small config with random weights and saved with
``save_pretrained`` to ``tmp_path``; nothing is downloaded. ``transformers`` is a test-only
dependency. Weights are re-drawn at unit scale so logits are O(1) and a 1e-4 tolerance means
something (Hugging Face's 0.02-std init gives logits near zero).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.assemble import build_model
from yamlformer.builder.hf import (
    TOKEN_KEYS,
    from_hf,
    import_hf,
    load_weights,
    read_weights,
    to_hf,
)
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
VOCAB = 120
GEN_TOKENS = 6


@dataclass
class Case:
    make: Callable[[], object]  # a transformers model with random weights
    kind: str  # causal | mlm | seq2seq
    edit: Callable[[Path], None] | None = None  # rewrites the saved folder (a real checkpoint's quirks)


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=32, bos_token_id=None, eos_token_id=None
        )
    )


def _gpt2_inverse_scale():  # scores also divided by (layer index + 1): per-layer attention.scale overrides
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=3,
            n_head=2,
            n_positions=32,
            n_inner=48,
            activation_function="relu",
            scale_attn_by_inverse_layer_idx=True,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    )


def _llama3():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 500000.0,
    }
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_parameters=rope,
            rms_norm_eps=1e-5,
            bos_token_id=None,
            eos_token_id=None,
        )
    )


def _llama_bias():  # Llama 1/2 layout with attention_bias and mlp_bias, tied embeddings
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
        )
    )


def _mistral():
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=4,
            bos_token_id=None,
            eos_token_id=None,
        )
    )


def _mixtral():
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            sliding_window=None,
            bos_token_id=None,
            eos_token_id=None,
        )
    )


def _qwen2():  # q/k/v biases, tied, the second layer on a sliding window
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        )
    )


def _gemma():  # head_dim 16 with d_model 32 and 4 heads; MQA
    return transformers.GemmaForCausalLM(
        transformers.GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    )


def _gemma2():  # sandwich norms, softcaps that bite, query_pre_attn_scalar != head_dim, windows on 0 and 2
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=3,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    )


def _gemma2_without_layer_types(folder: Path) -> None:
    """A transformers 4.x Gemma 2 config: no `layer_types`; even layers slide."""
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("layer_types") == ["sliding_attention", "full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(config))


def _deepseek_v2():  # MLA without query compression, YaRN with DeepSeek's mscale, V2's group-limited routing
    return transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        )
    )


def _deepseek_v3():  # query compression, attention biases, sigmoid routing over groups with the expert bias
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=2,
            attention_bias=True,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        )
    )


def _mpt():  # ALiBi over a power-of-two head count, tied
    return transformers.MptForCausalLM(
        transformers.MptConfig(
            d_model=64,
            n_heads=4,
            n_layers=2,
            vocab_size=VOCAB,
            max_seq_len=32,
        )
    )


def _mpt_six_heads():  # six heads: MPT's slopes for a head count that is not a power of two; softmax_scale; untied
    return transformers.MptForCausalLM(
        transformers.MptConfig(
            d_model=48,
            n_heads=6,
            n_layers=2,
            vocab_size=VOCAB,
            max_seq_len=32,
            layer_norm_epsilon=1e-6,
            attn_config={"softmax_scale": 0.2},
            tie_word_embeddings=False,
        )
    )


def _bert():
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            type_vocab_size=2,
        )
    )


def _t5(**kwargs):
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            decoder_start_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
    )


def _untie_t5(folder: Path) -> None:
    """A T5 v1.1 checkpoint as published: its own lm_head and `tie_word_embeddings: false`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["shared.weight"]) * 0.3
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))


def _marian():
    return transformers.MarianMTModel(
        transformers.MarianConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=48,
            max_position_embeddings=32,
            activation_function="swish",
            scale_embedding=True,
            pad_token_id=0,
            decoder_start_token_id=0,
            eos_token_id=None,
            forced_eos_token_id=None,
            bos_token_id=None,
        )
    )


def _pegasus():
    config = {k: v for k, v in _marian().config.to_dict().items() if k in _SEQ2SEQ_SIZES}
    return transformers.PegasusForConditionalGeneration(
        transformers.PegasusConfig(**config, activation_function="gelu", scale_embedding=True)
    )


_SEQ2SEQ_SIZES = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "max_position_embeddings",
    "pad_token_id",
    "decoder_start_token_id",
    "eos_token_id",
    "forced_eos_token_id",
    "bos_token_id",
)


CASES = {
    "gpt2": Case(_gpt2, "causal"),
    "gpt2-inverse-scale-untied": Case(_gpt2_inverse_scale, "causal"),
    "llama3": Case(_llama3, "causal"),
    "llama-bias-tied": Case(_llama_bias, "causal"),
    "mistral": Case(_mistral, "causal"),
    "mixtral": Case(_mixtral, "causal"),
    "qwen2": Case(_qwen2, "causal"),
    "gemma": Case(_gemma, "causal"),
    "gemma2": Case(_gemma2, "causal"),
    "gemma2-4.x-config": Case(_gemma2, "causal", edit=_gemma2_without_layer_types),
    "deepseek_v2": Case(_deepseek_v2, "causal"),
    "deepseek_v3": Case(_deepseek_v3, "causal"),
    "mpt": Case(_mpt, "causal"),
    "mpt-6-heads-scale-untied": Case(_mpt_six_heads, "causal"),
    "bert": Case(_bert, "mlm"),
    "t5-v1.0": Case(_t5, "seq2seq"),
    "t5-v1.1": Case(lambda: _t5(feed_forward_proj="gated-gelu"), "seq2seq", edit=_untie_t5),
    "marian": Case(_marian, "seq2seq"),
    "pegasus": Case(_pegasus, "seq2seq"),
}


def _randomize(model) -> None:
    """Unit-scale weights (and Marian's logits bias) so logits are O(1)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:  # Marian's sinusoids
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(
                    0.5 + torch.rand(p.shape, generator=gen)
                    if "norm" in name.lower()
                    else 0.2 * torch.randn(p.shape, generator=gen)
                )
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's balancing bias changes the choice
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def _hf_model(case: Case, folder: Path):
    torch.manual_seed(0)
    model = case.make()
    _randomize(model)
    model.save_pretrained(folder)
    if case.edit is not None:
        case.edit(folder)
    auto = {
        "causal": transformers.AutoModelForCausalLM,
        "mlm": transformers.AutoModelForMaskedLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[case.kind]
    return auto.from_pretrained(folder).eval(), auto


def _batch(kind: str):
    """Right-padded inputs: row 1 ends in padding."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if kind == "mlm":
        inputs["token_type_ids"] = torch.randint(0, 2, ids.shape, generator=gen)
    if kind == "seq2seq":
        tgt = torch.randint(1, VOCAB, (2, 7), generator=gen)
        tgt_mask = torch.ones_like(tgt)
        tgt_mask[0, 5:] = 0
        inputs.update(decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    return inputs


def _logits(model, inputs, ours: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs) if ours else model(**inputs).logits


def _kept(inputs) -> torch.Tensor:
    """The positions whose logits count: the non-padded ones."""
    return inputs.get("decoder_attention_mask", inputs["attention_mask"]) == 1


def _hf_params(hf) -> int:
    """Hugging Face's count (tied tensors once), as our spec counts: Marian's frozen sinusoid
    tables are parameters there and computed here; its logits bias is a buffer there and the
    head's bias parameter here."""
    total = sum(p.numel() for n, p in hf.named_parameters() if not n.endswith("embed_positions.weight"))
    return total + sum(b.numel() for n, b in hf.named_buffers() if n.endswith("final_logits_bias"))


def _greedy(case, hf, ours, inputs):
    ids, mask = inputs["input_ids"][:, :5], inputs["attention_mask"][:, :5]
    common = {"max_new_tokens": GEN_TOKENS}
    if case.kind == "seq2seq":
        theirs = hf.generate(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            do_sample=False,
            num_beams=1,
            min_new_tokens=GEN_TOKENS,
            decoder_start_token_id=0,
            **common,
        )
        mine = ours.generate(
            inputs["input_ids"], attention_mask=inputs["attention_mask"], decoder_start_token_id=0, **common
        )
    else:
        theirs = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(mask),
            do_sample=False,
            num_beams=1,
            min_new_tokens=GEN_TOKENS,
            pad_token_id=0,
            **common,
        )
        mine = ours.generate(ids, **common)
    return theirs, mine


def test_every_family_has_a_parity_case():
    """A family (a new block's Hugging Face table among them) cannot land without a case below,
    or in the ``CASES`` of a ``tests/test_hf_*.py`` file that runs these checks on its own."""
    import importlib

    from yamlformer.builder.hf import FAMILIES

    cases = list(CASES.values())
    for path in sorted(Path(__file__).parent.glob("test_hf_*.py")):
        cases += getattr(importlib.import_module(path.stem), "CASES", {}).values()
    covered = {case.make().config.model_type for case in cases}
    assert not set(FAMILIES) - covered, f"families without a parity case: {sorted(set(FAMILIES) - covered)}"


@pytest.mark.parametrize("name", list(CASES))
def test_import_matches_logits_generation_count_and_export(name, tmp_path):
    case = CASES[name]
    hf, auto = _hf_model(case, tmp_path / "hf")

    spec_path, weights_path = import_hf(tmp_path / "hf", tmp_path / "ours")
    spec = load_spec(spec_path)  # the written YAML reads back through the project's loader
    ours = load_weights(build_model(spec), weights_path).eval()

    inputs = _batch(case.kind)
    theirs_logits, our_logits = _logits(hf, inputs, ours=False), _logits(ours, inputs, ours=True)
    kept = _kept(inputs)
    assert our_logits.shape == theirs_logits.shape
    assert theirs_logits[kept].std() > 0.1, "logits too small for the tolerance to mean anything"
    diff = (our_logits[kept] - theirs_logits[kept]).abs().max().item()
    assert diff < 1e-4, f"{name}: max |logit difference| {diff:.3g}"

    if case.kind != "mlm":
        theirs_tokens, our_tokens = _greedy(case, hf, ours, inputs)
        assert torch.equal(our_tokens, theirs_tokens), f"{name}:\nours   {our_tokens}\ntheirs {theirs_tokens}"

    assert estimate(spec).params.total == _hf_params(hf)

    # export: Hugging Face loads it with identical logits, and it reads back bit for bit
    original_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tokens = {k: original_config[k] for k in TOKEN_KEYS if original_config.get(k) is not None}
    to_hf(spec, ours, tmp_path / "export", extra_config=tokens)
    again = auto.from_pretrained(tmp_path / "export").eval()
    assert torch.equal(_logits(again, inputs, ours=False), theirs_logits)
    spec_again, state_again = from_hf(tmp_path / "export")
    original = read_weights(weights_path)
    assert set(state_again) == set(original)
    assert all(torch.equal(state_again[k], original[k]) for k in original)
    assert spec_again.model_dump(exclude={"name"}) == spec.model_dump(exclude={"name"})
