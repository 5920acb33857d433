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
families that have one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: config.json keys that are not architecture: written elsewhere (token ids, by the vocabulary)
#: or not read at all (the file's bookkeeping)
NOT_ARCHITECTURE = frozenset(
    {
        "model_type",
        "architectures",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "forced_eos_token_id",
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
    #: what this entry was proven with (the llamacpp tests' names), for the docs and errors
    proven: str = ""
    extra: dict = field(default_factory=dict)

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


def _llama_refuse(config: Mapping) -> str | None:
    if config.get("hidden_act", "silu") != "silu":
        return (
            f"{field_of('hidden_act')}: {config['hidden_act']!r}; llama.cpp's llama architecture "
            "runs a SiLU-gated FFN only"
        )
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) != "linear":
        kind = scaling.get("rope_type", scaling.get("type"))
        return f"{field_of('rope_scaling')}: {kind!r} RoPE scaling is not written yet (linear only)"
    if config.get("sliding_window"):
        return (
            f"{field_of('sliding_window')}: {config['sliding_window']}; llama.cpp's llama architecture "
            "(which runs Mistral) has no sliding-window key: it would attend over the whole context"
        )
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

LLAMA = Arch("LLAMA", _LLAMA_KEYS, _common, _llama_refuse, _llama_transform, proven="llama")

#: Hugging Face family -> how it is written
ARCHES: dict[str, Arch] = {"llama": LLAMA, "mistral": LLAMA}


def arch_of(family: str) -> Arch:
    if family not in ARCHES:
        known = ", ".join(sorted(ARCHES))
        raise Refused(
            f"the spec is Hugging Face {family}; no GGUF architecture is written (and proven in llama.cpp) "
            f"for it yet: only {known}"
        )
    return ARCHES[family]
