"""The GGUF architectures we write: for each Hugging Face family (the one ``builder export-hf``
picks, :mod:`yamlformer.builder.hf.writer`), the llama.cpp architecture that runs it, the
hyperparameter keys it reads, the tensor layouts it expects, and every config key it cannot
honour, named by the spec field that set it.

An entry is :class:`Arch`. Its ``keys`` are the family's ``config.json`` keys it writes as GGUF
metadata (or knows to be irrelevant at inference, such as dropout); a config key outside them
with a value that changes the computation is refused, so a family's new feature is refused
until an entry here says how llama.cpp reads it: never a file that loads and computes something
else. ``refuse`` adds the checks on values (an activation llama.cpp's graph does not use, a
sliding window an architecture has no key for). A family without an entry is refused with the
families that have one (:func:`yamlformer.builder.gguf.arches_more.arch_of`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from yamlformer.builder.hf.families import TOKEN_KEYS

#: config.json keys that are not architecture: written elsewhere (token ids, by the vocabulary)
#: or not read at all (the file's bookkeeping)
NOT_ARCHITECTURE = frozenset(
    {
        *TOKEN_KEYS,
        "model_type",
        "architectures",
        "dtype",
        "torch_dtype",
        "attention_dropout",
        "router_jitter_noise",
        "initializer_range",
    }
)

#: the spec field a config key comes from, for refusals
FIELDS = {
    "hidden_act": "decoder.ffn.activation",
    "rope_scaling": "position.scaling",
    "sliding_window": "decoder.attention.sliding_window",
    "layer_types": "decoder.overrides (per-layer attention windows)",
    "mlp_bias": "decoder.ffn.bias",
    "attention_bias": "decoder.attention.qkv_bias",
    "head_dim": "decoder.attention.head_dim",
}


class Refused(ValueError):
    """The spec holds something the GGUF architecture cannot say: one line naming the field."""


def field_of(key: str) -> str:
    return f"{FIELDS[key]} (config {key})" if key in FIELDS else f"config {key}"


def masks_nothing(span: int | None, context: int) -> bool:
    """Whether a window (or chunk) of ``span`` keys masks nothing within the context a GGUF
    declares (``max_position_embeddings``: the spec's ``max_seq_len``): none, or one at least as
    long (the farthest key is ``context - 1`` back, and in the first chunk)."""
    return not span or span >= context


def window_refusal(config: Mapping, lacks: str) -> str | None:
    """A sliding window the architecture does not apply (``lacks``: how it says so) refused
    where it masks something; one that masks nothing (:func:`masks_nothing`) computes the same
    without it, and is written without it."""
    window, context = config.get("sliding_window"), config["max_position_embeddings"]
    if masks_nothing(window, context):
        return None
    return (
        f"{field_of('sliding_window')}: {window} < max_seq_len {context}; llama.cpp's {lacks}: it would "
        "attend over the whole context (a window >= max_seq_len is written)"
    )


@dataclass
class Arch:
    """How one Hugging Face family is written as one llama.cpp architecture."""

    #: ``gguf.MODEL_ARCH`` member name (``"LLAMA"``)
    name: str
    #: the family's config keys this entry writes or knows not to matter
    keys: frozenset[str]
    #: ``(writer, config, spec)``: the architecture's hyperparameters
    hparams: Callable[[Any, Mapping, Any], None]
    #: ``(config) -> str | None``: the first thing the architecture lacks, beyond unknown keys
    refuse: Callable[[Mapping], str | None] = lambda config: None
    #: ``(hf_name, tensor, config) -> [(hf_name, tensor)]``: layouts llama.cpp expects
    transform: Callable[[str, Any, Mapping], Iterable[tuple[str, Any]]] = lambda n, t, c: [(n, t)]
    #: ``(config) -> {gguf_name: tensor}``: tensors llama.cpp reads that the family computes
    #: (Llama 3's RoPE frequency factors)
    extra: Callable[[Mapping], dict] = lambda config: {}
    #: the Hugging Face families whose LoRA adapters are written alone (``export-gguf
    #: --adapters-only``, proven in llama.cpp): ``transform`` of their linear weights only reorders
    #: rows, which ``lora_B`` takes the same way
    lora: frozenset[str] = frozenset()

    def check(self, config: Mapping, family: str) -> None:
        """:class:`Refused` for the first config key or value the architecture cannot honour."""
        for key, value in config.items():
            if key in self.keys or key in NOT_ARCHITECTURE:
                continue
            if value in (None, False, 0, 0.0, [], {}):
                continue
            raise Refused(
                f"{field_of(key)}: llama.cpp's {self.name.lower()} architecture (for Hugging Face {family}) "
                "has no GGUF key for it; not written"
            )
        why = self.refuse(config)
        if why:
            raise Refused(why)


# --- llama ---------------------------------------------------------------------------------


def _permute(weights, n_head: int):
    """Hugging Face's rotate-half q/k rows to the interleaved pairs llama.cpp's llama graph
    rotates (convert_hf_to_gguf's ``LlamaModel.permute``)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama_transform(name: str, tensor, config: Mapping):
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        tensor = _permute(tensor, config["num_attention_heads"])
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        tensor = _permute(tensor, config.get("num_key_value_heads") or config["num_attention_heads"])
    return [(name, tensor)]


def _common(writer, config: Mapping, spec) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if config.get("num_local_experts"):
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        import gguf  # optional extra: written only when a file is

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def _llama3_factors(config: Mapping) -> dict:
    """Llama 3's RoPE scaling as llama.cpp takes it: each frequency's divisor, ``rope_freqs``
    (convert_hf_to_gguf's formula, which is transformers' ``llama3`` rope)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "llama3":
        return {}
    # local: torch loads when weights are converted
    import torch

    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (float(config["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen > old / low:
            factors.append(factor)
        elif wavelen < old / high or low == high:  # equal factors: one threshold, no band (Llama 4's)
            factors.append(1.0)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(factors, dtype=torch.float32)}


def _llama_refuse(config: Mapping, llama3: bool = False) -> str | None:
    """What llama.cpp's llama-layout graphs lack; ``llama3``: the architecture writes Llama 3's
    RoPE factors (llama only)."""
    if config.get("hidden_act", "silu") != "silu":
        return (
            f"{field_of('hidden_act')}: {config['hidden_act']!r}; llama.cpp's llama architecture "
            "runs a SiLU-gated FFN only"
        )
    scaling = config.get("rope_scaling")
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    written = ("linear", "llama3") if llama3 else ("linear",)
    if scaling and kind not in written:
        only = ", ".join(written)
        return f"{field_of('rope_scaling')}: {kind!r} RoPE scaling is not written for this architecture ({only} only)"
    why = window_refusal(config, "llama architecture (which runs Mistral) has no sliding-window key")
    if why:
        return why
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim % 2:
        return f"{field_of('head_dim')}: {head_dim} is odd; RoPE needs pairs"
    return None


_LLAMA_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "num_local_experts",
        "num_experts_per_tok",
    }
)
#: Qwen's sliding-window switches: refused when on (``_qwen_refuse``)
_QWEN_KEYS = _LLAMA_KEYS | {"layer_types", "use_sliding_window", "max_window_layers"}


def _qwen_refuse(config: Mapping) -> str | None:
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        return (
            f"{field_of('sliding_window')}: llama.cpp's qwen architectures have no sliding-window key: "
            "they would attend over the whole context"
        )
    return _llama_refuse({**config, "sliding_window": None})


def _qwen_moe_hparams(writer, config: Mapping, spec) -> None:
    _common(writer, config, spec)
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _qwen_moe_refuse(config: Mapping) -> str | None:
    if not config.get("norm_topk_prob", False):
        return "decoder.ffn.norm_topk_prob: false; llama.cpp's qwen3moe renormalizes the chosen experts' weights"
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        return "decoder.overrides (dense FFN layers among the experts): llama.cpp's qwen3moe has every layer sparse"
    return _qwen_refuse(config)


def _olmo2_refuse(config: Mapping) -> str | None:
    return _llama_refuse({**config, "sliding_window": None})


# --- GPT-2, GPT-NeoX -------------------------------------------------------------------------


def _gpt2_hparams(writer, config: Mapping, spec) -> None:
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(float(config["layer_norm_epsilon"]))
    writer.add_vocab_size(config["vocab_size"])


def _gpt2_transform(name: str, tensor, config: Mapping):
    """Hugging Face's Conv1D matrices are (in, out); llama.cpp's gpt2 reads (out, in) rows."""
    if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        tensor = tensor.transpose(0, 1).contiguous()
    return [(name, tensor)]


def _gpt2_refuse(config: Mapping) -> str | None:
    activation = config.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        return (
            f"decoder.ffn.activation (config activation_function): {activation!r}; llama.cpp's gpt2 "
            "computes GELU's tanh approximation"
        )
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("scale_attn_weights") is False:
        return "decoder.attention.scale: llama.cpp's gpt2 scales scores by 1/sqrt(head_dim) only"
    return None


def _neox_hparams(writer, config: Mapping, spec) -> None:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_rope_dimension_count(int(config["rotary_pct"] * head_dim))
    writer.add_rope_freq_base(float(config["rotary_emb_base"]))
    writer.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
    writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])


def _neox_transform(name: str, tensor, config: Mapping):
    """Hugging Face's fused qkv rows, per head (q, k, v), to llama.cpp's (all q, all k, all v)."""
    if name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
        n_head = config["num_attention_heads"]
        d = config["hidden_size"]
        parts = tensor.reshape(n_head, 3, d // n_head, *tensor.shape[1:])
        tensor = torch_cat([parts[:, i].reshape(d, *tensor.shape[1:]) for i in range(3)])
    return [(name, tensor)]


def torch_cat(tensors):
    # local: torch loads when weights are converted
    import torch

    return torch.cat(tensors, dim=0)


def _neox_refuse(config: Mapping) -> str | None:
    if config.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        return f"decoder.ffn.activation (config hidden_act): {config['hidden_act']!r}; llama.cpp's gptneox runs GELU"
    if config.get("rope_scaling") or (config.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        return f"{field_of('rope_scaling')}: llama.cpp's gptneox has no RoPE scaling key written here"
    return None


_GPT2_KEYS = frozenset(
    {"vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner", "activation_function",
     "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "tie_word_embeddings",
     "embd_pdrop", "attn_pdrop", "resid_pdrop"}
)  # fmt: skip
_NEOX_KEYS = frozenset(
    {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
     "layer_norm_eps", "attention_bias", "use_parallel_residual", "max_position_embeddings", "tie_word_embeddings",
     "hidden_dropout", "rope_parameters", "rotary_emb_base", "rotary_pct", "rope_scaling"}
)  # fmt: skip

# --- Gemma 2, Gemma 3 ------------------------------------------------------------------------


def _gemma_hparams(writer, config: Mapping, spec) -> None:
    _common(writer, {**config, "rope_scaling": None}, spec)
    types = config.get("layer_types") or []
    if "sliding_attention" in types:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if config.get("rope_local_base_freq") is not None:
        writer.add_rope_freq_base_swa(float(config["rope_local_base_freq"]))
    elif "sliding_attention" in types:
        writer.add_rope_freq_base_swa(float(config["rope_theta"]))
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _gemma_transform(name: str, tensor, config: Mapping):
    """Gemma's norms scale by (1 + weight); llama.cpp's by the weight (convert_hf_to_gguf adds 1)."""
    return [(name, tensor + 1 if name.endswith("norm.weight") else tensor)]


def _gemma_refuse(arch: str, large: int, always_capped: bool):
    def refuse(config: Mapping) -> str | None:
        if config.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
            return (
                f"decoder.ffn.activation (config hidden_activation): {config['hidden_activation']!r}; "
                f"llama.cpp's {arch} computes GELU's tanh approximation"
            )
        if config.get("rope_scaling"):
            return f"{field_of('rope_scaling')}: llama.cpp's {arch} reads no RoPE scaling here"
        head_dim = config["head_dim"]
        # llama.cpp fixes the score scale: 1/sqrt(head_dim), or 1/sqrt(d/heads) for the 27B's layer count
        fixed = head_dim
        if config["num_hidden_layers"] == large:
            fixed = config["hidden_size"] // config["num_attention_heads"]
        if config.get("query_pre_attn_scalar", head_dim) != fixed:
            return (
                f"decoder.attention.scale (config query_pre_attn_scalar): {config['query_pre_attn_scalar']}; "
                f"llama.cpp's {arch} scales scores by 1/sqrt({fixed}) for this shape"
            )
        if always_capped and not (config.get("attn_logit_softcapping") and config.get("final_logit_softcapping")):
            return (
                f"decoder.attention.softcap / head.softcap: none; llama.cpp's {arch} always caps scores and "
                "logits (50 and 30 by default)"
            )
        if not always_capped and config.get("attn_logit_softcapping"):
            return f"decoder.attention.softcap: llama.cpp's {arch} has no attention softcap"
        return None

    return refuse


_GEMMA_KEYS = (_QWEN_KEYS - {"hidden_act"}) | {
    "hidden_activation",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "rope_parameters",
    "rope_local_base_freq",
}


LLAMA = Arch(
    "LLAMA",
    _LLAMA_KEYS,
    _common,
    lambda config: _llama_refuse(config, llama3=True),
    _llama_transform,
    _llama3_factors,
    lora=frozenset({"llama"}),
)
#: Qwen's tensors go unchanged (llama.cpp's qwen graphs rotate halves, as transformers' do), so
#: their adapters do too; q/k/v biases and q/k norms are the base's (LoRA adapts the matrices only)
QWEN2 = Arch("QWEN2", _QWEN_KEYS, _common, _qwen_refuse, lora=frozenset({"qwen2"}))
QWEN3 = Arch("QWEN3", _QWEN_KEYS, _common, _qwen_refuse, lora=frozenset({"qwen3"}))
QWEN3MOE = Arch(
    "QWEN3MOE",
    _QWEN_KEYS | {"num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
    _qwen_moe_hparams,
    _qwen_moe_refuse,
)
OLMO2 = Arch("OLMO2", _LLAMA_KEYS, _common, _olmo2_refuse)
GPT2 = Arch("GPT2", _GPT2_KEYS, _gpt2_hparams, _gpt2_refuse, _gpt2_transform)
GPTNEOX = Arch("GPTNEOX", _NEOX_KEYS, _neox_hparams, _neox_refuse, _neox_transform)
GEMMA2 = Arch("GEMMA2", _GEMMA_KEYS, _gemma_hparams, _gemma_refuse("gemma2", 46, True), _gemma_transform)
GEMMA3 = Arch("GEMMA3", _GEMMA_KEYS, _gemma_hparams, _gemma_refuse("gemma3", 62, False), _gemma_transform)

#: Hugging Face family -> how it is written (each proven by tests/test_gguf_llamacpp.py); with
#: :mod:`.arches_more`'s, :data:`yamlformer.builder.gguf.arches_more.ARCHES`
ARCHES: dict[str, Arch] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "mixtral": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3MOE,
    "olmo2": OLMO2,
    "gpt2": GPT2,
    "gpt_neox": GPTNEOX,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
}
