"""More GGUF architectures (:class:`~yamlformer.builder.gguf.arches.Arch` entries, as in
:mod:`.arches`): Phi-3's, and the table of every family written, :data:`ARCHES`, with
:func:`arch_of`. They sit here, not in :mod:`.arches`, because they build on its helpers: the
table that names them all must import both, so it is this module's.

Each entry is proven in llama.cpp by ``tests/test_gguf_llamacpp.py`` like the others.
"""

from __future__ import annotations

from collections.abc import Mapping

from yamlformer.builder.gguf import arches
from yamlformer.builder.gguf.arches import _LLAMA_KEYS, Arch, Refused, _common, _llama_refuse, field_of

# --- Phi-3 ---------------------------------------------------------------------------------


def _phi3_refuse(config: Mapping) -> str | None:
    """llama.cpp's phi3 disables sliding windows (``src/models/phi3.cpp``: "Phi SWA is currently
    disabled") and attends over the whole context. A window at least the context it declares
    (``max_position_embeddings``: the spec's ``max_seq_len``) masks nothing there (the farthest
    key is ``max_seq_len - 1`` back), so it computes the same and is written without a window;
    a shorter one would not be, and is refused."""
    window, context = config.get("sliding_window"), config["max_position_embeddings"]
    if window and window < context:
        return (
            f"{field_of('sliding_window')}: {window} < max_seq_len {context}; llama.cpp's phi3 disables "
            "sliding windows: it would attend over the whole context (a window >= max_seq_len is written)"
        )
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        return (
            f"{field_of('head_dim')}: {head_dim} x {config['num_attention_heads']} heads != d_model "
            f"{config['hidden_size']}; llama.cpp's phi3 takes head_dim = d_model / n_heads"
        )
    return _llama_refuse({**config, "sliding_window": None})


#: Phi-3's config: Mistral's keys and the residual dropout (nothing at inference). Its q, k, v
#: and gate, up come fused (``qkv_proj``, ``gate_up_proj``) as llama.cpp's phi3 reads them
#: (``attn_qkv``: q rows, k, v; ``ffn_up``: gate rows, then up), and it rotates halves, as
#: llama.cpp's phi3 RoPE does (NeoX order): the tensors go unchanged.
PHI3 = Arch(
    "PHI3",
    (_LLAMA_KEYS - {"attention_bias", "mlp_bias", "num_local_experts", "num_experts_per_tok"}) | {"resid_pdrop"},
    _common,
    _phi3_refuse,
)


# --- MPT -----------------------------------------------------------------------------------


def _mpt_hparams(writer, config: Mapping, spec) -> None:
    writer.add_block_count(config["n_layers"])
    writer.add_context_length(config["max_seq_len"])
    writer.add_embedding_length(config["d_model"])
    writer.add_feed_forward_length(config["expansion_ratio"] * config["d_model"])
    writer.add_head_count(config["n_heads"])
    writer.add_layer_norm_eps(float(config["layer_norm_epsilon"]))
    writer.add_vocab_size(config["vocab_size"])
    # ALiBi's slopes from it: ggml's soft_max (``ops.cpp``) takes m0 = 2^(-bias / n), m1 =
    # 2^(-bias / 2n) over n, the power of two at or below the head count, head h < n sloping
    # m0^(h + 1) and the rest m1^(2(h - n) + 1): ALiBi's series and every other slope of twice n,
    # as yamlformer.blocks.positions.alibi_slopes (tests/test_gguf_export.py checks every count)
    writer.add_max_alibi_bias(float(config["attn_config"]["alibi_bias_max"]))


def _mpt_refuse(config: Mapping) -> str | None:
    attn = config["attn_config"]
    if attn.get("softmax_scale") is not None:
        return (
            f"decoder.attention.scale (config attn_config.softmax_scale): {attn['softmax_scale']}; "
            "llama.cpp's mpt scales scores by 1/sqrt(head_dim) only"
        )
    for key, plain in (("alibi", True), ("clip_qkv", None), ("qk_ln", False), ("prefix_lm", False)):
        if attn.get(key, plain) != plain:
            return f"config attn_config.{key}: {attn[key]}; written for ALiBi without clamping, q/k norms or a prefix"
    if attn.get("attn_type", "multihead_attention") != "multihead_attention" or attn.get("kv_n_heads"):
        return "decoder.attention.n_kv_heads (config attn_config.attn_type): written for multi-head attention only"
    if config.get("norm_type", "low_precision_layernorm") not in ("low_precision_layernorm", "layernorm"):
        return f"decoder.norm.type (config norm_type): {config['norm_type']!r}; llama.cpp's mpt runs LayerNorm"
    if not config.get("no_bias", True) or config.get("logit_scale") or config.get("embedding_fraction", 1.0) != 1.0:
        return (
            "config no_bias / logit_scale / embedding_fraction: llama.cpp's mpt has no biases written, no logit scale"
        )
    return None


#: MPT (ALiBi, bias-free LayerNorms, a 4d GELU MLP; ``transformers``' MptForCausalLM). Its
#: ``Wqkv`` rows (q, k, v) are llama.cpp's fused ``attn_qkv``, unchanged. llama.cpp's GELU (every
#: family's) is the tanh form from a half-precision table; MPT's exact GELU is within that
#: table's rounding of it, as GPT-NeoX's is in :mod:`.arches`.
MPT = Arch(
    "MPT",
    frozenset(
        {
            "vocab_size",
            "d_model",
            "n_heads",
            "n_layers",
            "expansion_ratio",
            "max_seq_len",
            "layer_norm_epsilon",
            "no_bias",
            "norm_type",
            "learned_pos_emb",
            "logit_scale",
            "embedding_fraction",
            "emb_pdrop",
            "resid_pdrop",
            "tie_word_embeddings",
            "attn_config",
        }
    ),  # fmt: skip
    _mpt_hparams,
    _mpt_refuse,
)


#: Hugging Face family -> how it is written (each proven by tests/test_gguf_llamacpp.py)
ARCHES: dict[str, Arch] = {
    **arches.ARCHES,
    "phi3": PHI3,
    "mpt": MPT,
}


def arch_of(family: str) -> Arch:
    if family not in ARCHES:
        known = ", ".join(sorted(ARCHES))
        raise Refused(
            f"the spec is Hugging Face {family}; no GGUF architecture is written (and proven in llama.cpp) "
            f"for it yet: only {known}"
        )
    return ARCHES[family]
