"""More GGUF architectures (:class:`~yamlformer.builder.gguf.arches.Arch` entries, as in
:mod:`.arches`): Phi-3's, MPT's (ALiBi), DeepSeek-V2's (latent attention), GPT-OSS's, the YaRN
they share, Llama 4's, and the table of every family written, :data:`ARCHES`, with
:func:`arch_of`. They sit here, not in :mod:`.arches`, because they build on its helpers: the table that names them
all must import both, so it is this module's.

Each entry is proven in llama.cpp by ``tests/test_gguf_llamacpp.py`` like the others.
"""

from __future__ import annotations

from collections.abc import Mapping

from yamlformer.builder.gguf import arches
from yamlformer.builder.gguf.arches import (
    _LLAMA_KEYS,
    Arch,
    Refused,
    _common,
    _llama_refuse,
    field_of,
    masks_nothing,
    window_refusal,
)

# --- Phi-3 ---------------------------------------------------------------------------------


def _phi3_refuse(config: Mapping) -> str | None:
    """llama.cpp's phi3 disables sliding windows (``src/models/phi3.cpp``: "Phi SWA is currently
    disabled") and attends over the whole context: a window is written only where it masks
    nothing (:func:`~yamlformer.builder.gguf.arches.window_refusal`)."""
    why = window_refusal(config, "phi3 disables sliding windows")
    if why:
        return why
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


# --- YaRN (DeepSeek-V2's, GPT-OSS's) -------------------------------------------------------


def _yarn_hparams(writer, scaling: Mapping | None, log_mul: bool) -> None:
    """YaRN as llama.cpp reads it: the factor, the trained context, the ramp's rotations, and
    (``log_mul``, DeepSeek's) ``mscale_all_dim`` as convert_hf_to_gguf writes it (times 0.1)."""
    if not scaling or scaling.get("rope_type") in (None, "default"):
        return
    import gguf  # optional extra: written only when a file is

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast", 32.0)))
    writer.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow", 1.0)))
    if log_mul:
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(scaling["mscale_all_dim"]))


def _yarn_refuse(scaling: Mapping | None, key: str, arch: str, deepseek: bool) -> str | None:
    """What llama.cpp's YaRN (ggml's rope, llama-context.cpp's factors) cannot say. Its ramp's ends
    are whole dimensions (``ggml_rope_yarn_corr_dims``: floor, ceil); the cos/sin factor it
    derives, 0.1 ln(factor) + 1, or for deepseek2 (``yarn_log_mul``) none and DeepSeek's
    (0.1 mscale_all_dim ln(factor) + 1)^2 on every score, which is ours only with mscale equal to
    mscale_all_dim (llama.cpp takes them equal)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return None
    field = f"position.scaling (config {key})"
    if kind != "yarn":
        return f"{field}: {kind!r}; written for llama.cpp's {arch} as YaRN only"
    if scaling.get("truncate", True) is False:
        return (
            f"position.scaling.truncate (config {key}.truncate): false; llama.cpp's YaRN rounds the ramp's "
            "ends to whole dimensions"
        )
    if scaling.get("attention_factor") is not None:
        return f"position.scaling.attention_factor: {scaling['attention_factor']}; llama.cpp derives it from the factor"
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if deepseek and (mscale_all_dim is None or mscale != mscale_all_dim):
        return (
            f"position.scaling.mscale / mscale_all_dim: {mscale}, {mscale_all_dim}; llama.cpp's deepseek2 "
            "takes DeepSeek's YaRN with the two equal"
        )
    if not deepseek and (mscale is not None or mscale_all_dim is not None):
        return f"position.scaling.mscale / mscale_all_dim: DeepSeek's YaRN; llama.cpp's {arch} has no key for them"
    return None


# --- DeepSeek-V2 ---------------------------------------------------------------------------

#: the latents' RMSNorm epsilon (DeepSeek's, fixed); llama.cpp normalizes them with the model's
LATENT_NORM_EPS = 1e-6


def _deepseek2_hparams(writer, config: Mapping, spec) -> None:
    import gguf  # optional extra: written only when a file is

    kv_rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA as llama.cpp runs it: one shared latent key/value (absorbed)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_rope_dimension_count(rope)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_q_lora_rank(config.get("q_lora_rank") or 0)  # 0: a plain q_proj (read as attn_q)
    writer.add_kv_lora_rank(kv_rank)
    writer.add_key_length(kv_rank + rope)
    writer.add_value_length(kv_rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor", 1.0)))
    writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    _yarn_hparams(writer, config.get("rope_scaling"), log_mul=True)


def _deepseek2_transform(name: str, tensor, config: Mapping):
    """``kv_b_proj`` (per head: the key's no-RoPE rows, then the value's) as llama.cpp's absorbed
    MLA takes it (convert_hf_to_gguf's DeepseekV2): ``k_b`` (heads, kv_lora_rank, nope), each
    head's key rows transposed, and ``v_b`` (heads, v_head_dim, kv_lora_rank)."""
    if not name.endswith("kv_b_proj.weight"):
        return [(name, tensor)]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    per_head = tensor.reshape(config["num_attention_heads"], nope + v, tensor.shape[-1])
    k_b, v_b = per_head[:, :nope], per_head[:, nope:]
    return [
        (name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()),
        (name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()),
    ]


def _deepseek2_refuse(config: Mapping) -> str | None:
    if config.get("hidden_act", "silu") != "silu":
        return f"{field_of('hidden_act')}: {config['hidden_act']!r}; llama.cpp's deepseek2 runs SiLU-gated FFNs only"
    if config.get("attention_bias"):
        return "decoder.attention.bias (config attention_bias): llama.cpp's deepseek2 reads no attention biases"
    why = _yarn_refuse(config.get("rope_scaling"), "rope_scaling", "deepseek2", deepseek=True)
    if why:
        return why
    if float(config["rms_norm_eps"]) != LATENT_NORM_EPS:
        return (
            f"decoder.norm.eps (config rms_norm_eps): {config['rms_norm_eps']}; llama.cpp's deepseek2 normalizes "
            f"the latents with it too (DeepSeek's latent norms use {LATENT_NORM_EPS})"
        )
    if (config.get("scoring_func") or "softmax") != "softmax":
        return f"decoder.ffn.scoring (config scoring_func): {config['scoring_func']!r}; written for softmax only"
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    if config.get("topk_method") == "group_limited_greedy" and groups > 1 and chosen < groups:
        return (
            f"decoder.ffn.topk_groups (config topk_group): {chosen} of {groups} groups by their best expert; "
            "llama.cpp's deepseek2 ranks groups by their two best experts' sum (DeepSeek-V3's), not written"
        )
    return None


#: DeepSeek-V2's multi-head latent attention (``q_lora_rank`` or a plain ``q_proj``,
#: ``kv_lora_rank``, the no-RoPE and RoPE key dims, ``v_head_dim``) and DeepSeekMoE (routed
#: and shared experts, the first ``first_k_dense_replace`` layers dense), as llama.cpp's
#: deepseek2 (interleaved RoPE pairs, as transformers' DeepseekV2 rotates: no permutation)
DEEPSEEK2 = Arch(
    "DEEPSEEK2",
    frozenset(
        {
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "attention_bias",
            "first_k_dense_replace",
            "max_position_embeddings",
            "rms_norm_eps",
            "tie_word_embeddings",
            "rope_theta",
            "rope_scaling",
            "hidden_act",
            "intermediate_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_intermediate_size",
            "routed_scaling_factor",
            "n_group",
            "topk_group",
            "norm_topk_prob",
            "topk_method",
            "scoring_func",
        }
    ),  # fmt: skip
    _deepseek2_hparams,
    _deepseek2_refuse,
    _deepseek2_transform,
)


# --- GPT-OSS -------------------------------------------------------------------------------

#: the clamped SwiGLU's constants llama.cpp's gpt-oss fixes (llama-graph.cpp, SWIGLU_OAI_MOE)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def _gpt_oss_hparams(writer, config: Mapping, spec) -> None:
    head_dim = config["head_dim"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)  # llama.cpp's gpt-oss sizes its heads by it
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    types = config["layer_types"]
    writer.add_sliding_window(config["sliding_window"] if "sliding_attention" in types else 0)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in types])
    _yarn_hparams(writer, config["rope_parameters"], log_mul=False)


def _gpt_oss_transform(name: str, tensor, config: Mapping):
    """transformers' fused experts as llama.cpp's (convert_hf_to_gguf's GptOss): ``gate_up_proj``
    ``(experts, d, 2 * hidden)``, gate and up columns interleaved, to ``gate_proj`` and ``up_proj``
    ``(experts, hidden, d)``; ``down_proj`` ``(experts, hidden, d)`` transposed; the sinks named as
    weights; a tied head written out (llama.cpp's gpt-oss reads its own ``output``)."""
    if name.endswith("experts.gate_up_proj"):
        rows = tensor.transpose(1, 2)  # (experts, 2 * hidden, d)
        return [(name[: -len("gate_up_proj")] + f"{part}_proj.weight", rows[:, i::2].contiguous())
                for i, part in enumerate(("gate", "up"))]  # fmt: skip
    if name.endswith("experts.gate_up_proj_bias"):
        return [(name[: -len("gate_up_proj_bias")] + f"{part}_proj.bias", tensor[:, i::2].contiguous())
                for i, part in enumerate(("gate", "up"))]  # fmt: skip
    if name.endswith("experts.down_proj"):
        return [(name + ".weight", tensor.transpose(1, 2).contiguous())]
    if name.endswith("experts.down_proj_bias"):
        return [(name.removesuffix("_bias") + ".bias", tensor)]
    if name.endswith("self_attn.sinks"):
        return [(name + ".weight", tensor)]
    if name == "model.embed_tokens.weight" and config.get("tie_word_embeddings"):
        return [(name, tensor), ("lm_head.weight", tensor)]
    return [(name, tensor)]


def _gpt_oss_refuse(config: Mapping) -> str | None:
    if (config.get("swiglu_alpha"), config.get("swiglu_limit")) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
        return (
            f"decoder.ffn.clamp (config swiglu_alpha, swiglu_limit): {config.get('swiglu_alpha')}, "
            f"{config.get('swiglu_limit')}; llama.cpp's gpt-oss fixes {SWIGLU_ALPHA}, {SWIGLU_LIMIT}"
        )
    if not config.get("attention_bias"):
        return "decoder.attention.qkv_bias (config attention_bias): false; llama.cpp's gpt-oss reads biased attention"
    return _yarn_refuse(config.get("rope_parameters"), "rope_parameters", "gpt-oss", deepseek=False)


#: GPT-OSS: attention sinks, biased q/k/v/o, alternating banded and full layers (written as the
#: per-layer pattern), a biased router over biased experts with the clamped SwiGLU, rotating
#: halves (NeoX order, as llama.cpp's gpt-oss); its post-attention norm is llama.cpp's
#: ``attn_post_norm`` by gguf's name map
GPT_OSS = Arch(
    "GPT_OSS",
    (_LLAMA_KEYS - {"rope_theta", "mlp_bias"}) | {"layer_types", "rope_parameters", "swiglu_alpha", "swiglu_limit"},
    _gpt_oss_hparams,
    _gpt_oss_refuse,
    _gpt_oss_transform,
)


# --- Llama 4 -------------------------------------------------------------------------------

#: what llama.cpp's llama4 fixes (``src/models/llama4.cpp``), whatever the file says: chunks of
#: 8192 tokens, NoPE on every 4th layer, and on those the queries times
#: ``log(floor((position + 1) / 8192) + 1) * 0.1 + 1``; q and k L2-normed on the RoPE layers
#: unless the model has 128 experts (its 17B-128E)
LLAMA4_CHUNK, LLAMA4_NOPE_STEP, LLAMA4_TEMPERATURE, LLAMA4_UNNORMED_EXPERTS = 8192, 4, (8192, 0.1), 128


def _llama4_view(config: Mapping) -> dict:
    """Llama 4's config in the keys the llama helpers read (``rope_theta``, ``rope_scaling``, the
    dense width as ``intermediate_size``, no window)."""
    rope = dict(config["rope_parameters"])
    theta = rope.pop("rope_theta")
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    return {**config, "rope_theta": theta, "rope_scaling": scaling, "sliding_window": None,
            "intermediate_size": config["intermediate_size_mlp"]}  # fmt: skip


def _llama4_pattern(config: Mapping) -> list[bool]:
    """The layers llama.cpp chunks (by its own :data:`LLAMA4_CHUNK`): ours, or all where none
    is (llama.cpp's chunked graph needs one; within its chunk's length nothing is masked)."""
    chunked = [kind == "chunked_attention" for kind in config["layer_types"]]
    return chunked if any(chunked) else [True] * len(chunked)


def _llama4_chunk_refuse(config: Mapping) -> str | None:
    """Each layer's chunk as it masks within the context
    (:func:`~yamlformer.builder.gguf.arches.masks_nothing`), ours against llama.cpp's."""
    chunk, context = config["attention_chunk_size"], config["max_position_embeddings"]
    for i, (kind, theirs) in enumerate(zip(config["layer_types"], _llama4_pattern(config), strict=True)):
        ours = chunk if kind == "chunked_attention" and not masks_nothing(chunk, context) else None
        fixed = LLAMA4_CHUNK if theirs and not masks_nothing(LLAMA4_CHUNK, context) else None
        if ours != fixed:
            return (
                f"decoder.attention.chunk_size (config attention_chunk_size, layer_types): layer {i} chunked by "
                f"{ours or 'none'} over max_seq_len {context}; llama.cpp's llama4 fixes chunks of {LLAMA4_CHUNK} "
                "(a chunk that masks nothing is written within those)"
            )
    return None


def _llama4_hparams(writer, config: Mapping, spec) -> None:
    view = _llama4_view(config)
    _common(writer, view, spec)
    moe = config["moe_layers"]
    writer.add_interleave_moe_layer_step(moe[0] + 1)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    # llama.cpp chunks by its own 8192 on the pattern's layers (a window of 0 would be MobileLLM's
    # graph: no chunks, no temperature, NoPE on the last layer only)
    writer.add_sliding_window(LLAMA4_CHUNK)
    writer.add_sliding_window_pattern(_llama4_pattern(config))


def _llama4_transform(name: str, tensor, config: Mapping):
    """transformers' fused experts as llama.cpp's (convert_hf_to_gguf's Llama4Model):
    ``gate_up_proj`` ``(experts, d, 2 * hidden)``, gate columns then up, to ``gate_proj`` and
    ``up_proj`` ``(experts, hidden, d)``; ``down_proj`` ``(experts, hidden, d)`` transposed. The
    q/k rows go unchanged: transformers' Llama 4 rotates interleaved pairs, as llama.cpp's."""
    if name.endswith("experts.gate_up_proj"):
        gate, up = tensor.transpose(1, 2).split(tensor.shape[-1] // 2, dim=1)
        stem = name[: -len("gate_up_proj")]
        return [(stem + "gate_proj.weight", gate.contiguous()), (stem + "up_proj.weight", up.contiguous())]
    if name.endswith("experts.down_proj"):
        return [(name + ".weight", tensor.transpose(1, 2).contiguous())]
    return [(name, tensor)]


def _llama4_refuse(config: Mapping) -> str | None:
    n_layers, moe = config["num_hidden_layers"], config["moe_layers"]
    if not moe:
        return "decoder.ffn: no mixture of experts; llama.cpp's llama4 needs one (dense Llama 4 is MobileLLM's graph)"
    step = moe[0] + 1
    if moe != list(range(step - 1, n_layers, step)):
        return (
            f"decoder.overrides (config moe_layers): experts on layers {moe}; llama.cpp's llama4 puts them on "
            "every n-th layer (interleave_moe_layer_step)"
        )
    fixed = [int((i + 1) % LLAMA4_NOPE_STEP != 0) for i in range(n_layers)]
    if config["no_rope_layers"] != fixed:
        nope = [i for i, rope in enumerate(config["no_rope_layers"]) if not rope]
        return (
            f"decoder.overrides attention.rope (config no_rope_layers): NoPE layers {nope}; llama.cpp's llama4 "
            f"fixes NoPE on every {LLAMA4_NOPE_STEP}th layer ({LLAMA4_NOPE_STEP - 1}, {2 * LLAMA4_NOPE_STEP - 1}, ...)"
        )
    why = _llama4_chunk_refuse(config) or _llama4_temperature_refuse(config)
    if why:
        return why
    normed = config["num_local_experts"] != LLAMA4_UNNORMED_EXPERTS
    if bool(config["use_qk_norm"]) != normed:
        return (
            f"decoder.attention.qk_norm (config use_qk_norm): {bool(config['use_qk_norm'])} with "
            f"{config['num_local_experts']} experts; llama.cpp's llama4 L2-norms q and k exactly when the "
            f"experts are not {LLAMA4_UNNORMED_EXPERTS}"
        )
    if config.get("attention_bias"):
        return "decoder.attention.qkv_bias (config attention_bias): llama.cpp's llama4 reads no attention biases"
    return _llama_refuse(_llama4_view(config), llama3=True)


def _llama4_temperature_refuse(config: Mapping) -> str | None:
    """llama.cpp's llama4 always tunes its NoPE layers' temperature by its fixed floor and scale;
    ours is the same if its floor and scale are those, or if both are 1 over the whole context
    (position + 1 below each floor: no tuning, or a floor past max_seq_len)."""
    context = config["max_position_embeddings"]
    if all(config["no_rope_layers"]):
        return None  # no NoPE layer to tune
    floor, scale = config["floor_scale"], float(config["attn_scale"])
    tuned = bool(config["attn_temperature_tuning"])
    if tuned and (floor, scale) == LLAMA4_TEMPERATURE:
        return None
    fixed_floor, fixed_scale = LLAMA4_TEMPERATURE
    if (not tuned or floor > context or scale == 0) and fixed_floor > context:
        return None
    said = f"{floor}, {scale}" if tuned else "none"
    return (
        f"decoder.overrides attention.temperature_tuning (config floor_scale, attn_scale): {said}; llama.cpp's "
        f"llama4 fixes floor_scale {fixed_floor}, scale {fixed_scale} on its NoPE layers"
    )


#: Llama 4's text model: chunked RoPE layers with an L2 QK-norm, NoPE layers with temperature
#: tuning, top-k sigmoid experts weighting their input plus a shared expert, interleaved with
#: dense layers, Llama 3's RoPE scaling (``rope_freqs``); as llama.cpp's llama4 runs it, which
#: fixes most of it (:data:`LLAMA4_CHUNK`): the rest is refused naming the field
LLAMA4 = Arch(
    "LLAMA4",
    frozenset(
        {
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "intermediate_size",
            "intermediate_size_mlp",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_layers",
            "interleave_moe_layer_step",
            "no_rope_layers",
            "attention_chunk_size",
            "layer_types",
            "use_qk_norm",
            "attn_temperature_tuning",
            "floor_scale",
            "attn_scale",
            "attention_bias",
            "max_position_embeddings",
            "rms_norm_eps",
            "tie_word_embeddings",
            "rope_parameters",
        }
    ),  # fmt: skip
    _llama4_hparams,
    _llama4_refuse,
    _llama4_transform,
    lambda config: arches._llama3_factors(_llama4_view(config)),
)


#: Hugging Face family -> how it is written (each proven by tests/test_gguf_llamacpp.py)
ARCHES: dict[str, Arch] = {
    **arches.ARCHES,
    "phi3": PHI3,
    "mpt": MPT,
    "deepseek_v2": DEEPSEEK2,
    "gpt_oss": GPT_OSS,
    "llama4_text": LLAMA4,
}


def arch_of(family: str) -> Arch:
    if family not in ARCHES:
        known = ", ".join(sorted(ARCHES))
        raise Refused(
            f"the spec is Hugging Face {family}; no GGUF architecture is written (and proven in llama.cpp) "
            f"for it yet: only {known}"
        )
    return ARCHES[family]
