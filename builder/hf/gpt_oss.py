"""GPT-OSS (``gpt_oss``, transformers' ``GptOssForCausalLM``).

The Llama layout (:class:`yamlformer.builder.hf.decoders.LlamaLayout`: GQA, RMSNorm, RoPE) with biased
q/k/v/o (``attention_bias``), alternating banded and full layers (``layer_types``; configs
without it: even layers slide), YaRN with fractional ramp ends (``truncate: false``), and what
GPT-OSS adds, each a spec field:

- attention sinks: a learned logit per head in every softmax row (``attention.sinks``);
- a mixture of experts whose router has a bias (``ffn.router_bias``), whose experts have biases
  (``ffn.expert_bias``) and compute the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``
  with the gate clamped above and up on both sides at ``swiglu_limit`` (``ffn.clamp``); the
  gates are the softmax of the chosen experts' logits, as ``moe``'s are. transformers' experts
  ignore ``hidden_act``, so it is read as the SwiGLU they compute.

On disk (``save_pretrained`` and the released checkpoints alike) the experts are fused and
transposed: ``gate_up_proj`` is ``(n_experts, d_model, 2 * hidden)`` with the gate and up columns
interleaved (gate ``[..., ::2]``, up ``[..., 1::2]``), ``down_proj`` ``(n_experts, hidden,
d_model)``, their biases beside them; here they are stacked per projection
(``experts.gate_proj``, ``up_proj``: ``(n_experts, hidden, d_model)``, ``down_proj``:
``(n_experts, d_model, hidden)``). Released checkpoints store the experts in MXFP4
(``quantization_config``), which is refused: dequantized weights (transformers'
``Mxfp4Config(dequantize=True)``, then ``save_pretrained``) read.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import Link, Unsupported
from yamlformer.builder.hf.decoders import LlamaKnobs, LlamaLayout
from yamlformer.builder.hf.layered import whole_head_rope

#: transformers' GptOssConfig defaults for the keys the Llama reader defaults otherwise
DEFAULTS = {
    "num_key_value_heads": 8,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
#: GptOssConfig's rope when a config names none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class GptOss(LlamaLayout):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        if config.get("quantization_config"):
            raise Unsupported(
                "gpt_oss: quantized experts (quantization_config, MXFP4 in the released checkpoints) are not "
                "read; save dequantized weights first (transformers' Mxfp4Config(dequantize=True), then "
                "save_pretrained)"
            )
        config = {**DEFAULTS, **config}
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": config.get("rope_theta", 150000.0)}
        config["hidden_act"] = "silu"  # GptOssExperts' SwiGLU, whatever hidden_act says
        spec = super().to_spec(config, names)
        stack = spec["decoder"]
        whole_head_rope(spec["position"], self.model_type)
        stack["attention"]["sinks"] = True
        stack["ffn"]["expert"]["bias"] = True  # what expert_bias means, said where the expert is
        stack["ffn"].update(
            router_bias=True,
            expert_bias=True,
            clamp={"alpha": float(config["swiglu_alpha"]), "limit": float(config["swiglu_limit"])},
        )
        return spec

    # spec -> config.json
    def to_config(self, spec) -> dict:
        ffn = spec.decoder.ffn
        if ffn.type != "moe":
            raise Unsupported(f"decoder.ffn is {ffn.type!r}; every gpt_oss layer is a mixture of experts (moe)")
        if ffn.clamp is None:
            raise Unsupported("ffn.clamp is null; gpt_oss's experts always clamp their SwiGLU (swiglu_alpha, _limit)")
        config = super().to_config(spec)
        config.pop("router_jitter_noise")  # Mixtral's; GPT-OSS has none
        theta, scaling = config.pop("rope_theta"), config.pop("rope_scaling")
        config.update(
            rope_parameters={**(scaling or {"rope_type": "default"}), "rope_theta": theta},
            swiglu_alpha=ffn.clamp.alpha,
            swiglu_limit=ffn.clamp.limit,
        )
        return config

    # tensor names
    def links(self, spec) -> list[Link]:
        # the Llama table's attention, norms, embedding and head; its (Mixtral) expert names replaced
        links = [link for link in super().links(spec) if ".block_sparse_moe." not in link.hf[0]]
        for i in range(spec.decoder.n_layers):
            layer = spec.decoder.layer(i)
            h, attn, ffn = f"model.layers.{i}", ours.attention("decoder", i), ours.ffn("decoder", i)
            if layer.attention.sinks:
                links.append(Link((f"{h}.self_attn.sinks",), (f"{attn}.sinks",)))
            links += moe_links(f"{h}.mlp", ffn, layer.ffn)
        return links


def moe_links(hf: str, ffn: str, config) -> list[Link]:
    """GPT-OSS's router and fused experts (see the module docstring) to ``moe``'s tensors."""
    if config.type != "moe":
        raise Unsupported(f"an ffn of type {config.type!r}; every gpt_oss layer is a mixture of experts (moe)")
    links = [Link((f"{hf}.router.weight",), (f"{ffn}.router.weight",))]
    if config.router_bias:
        links.append(Link((f"{hf}.router.bias",), (f"{ffn}.router.bias",)))
    experts = f"{ffn}.experts"  # ours: stacked (n_experts, out, in)
    links += [
        _interleaved(f"{hf}.experts.gate_up_proj", [f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"]),
        _transposed(f"{hf}.experts.down_proj", f"{experts}.down_proj.weight"),
    ]
    if config.expert_bias:
        links += [
            _interleaved(f"{hf}.experts.gate_up_proj_bias", [f"{experts}.gate_proj.bias", f"{experts}.up_proj.bias"]),
            Link((f"{hf}.experts.down_proj_bias",), (f"{experts}.down_proj.bias",)),
        ]
    return links


def _interleaved(hf: str, ours_: list[str]) -> Link:
    """``(n_experts, [d_model,] 2 * hidden)`` with gate and up columns interleaved (gate
    ``[..., ::2]``, up ``[..., 1::2]``) to our stacked gate and up, each ``(n_experts, hidden,
    d_model)`` for a weight (transposed), ``(n_experts, hidden)`` for a bias."""

    def flip(t):
        return t.transpose(1, 2) if t.dim() == 3 else t

    def to_ours(ts):
        return [flip(ts[0][..., half::2]).contiguous() for half in (0, 1)]

    def to_hf(ts):
        # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
        import torch

        pair = torch.stack([flip(t) for t in ts], dim=-1)  # (n_experts, [d_model,] hidden, 2)
        return [pair.reshape(*pair.shape[:-2], -1).contiguous()]  # gate, up, gate, up, ...

    return Link((hf,), tuple(ours_), to_ours, to_hf)


def _transposed(hf: str, our: str) -> Link:
    """``(n_experts, hidden, d_model)`` to our ``(n_experts, d_model, hidden)``, and back."""

    def flip(ts):
        return [ts[0].transpose(1, 2).contiguous()]

    return Link((hf,), (our,), flip, flip)


FAMILIES = [
    GptOss(
        LlamaKnobs(
            default_theta=150000.0,
            attention_bias_key=True,
            windows="layer_types",
            default_layer_types="alternate",
            moe=True,
        ),
        model_type="gpt_oss",
        hf_class="GptOssForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="GPT-OSS: attention sinks, alternating banded/full layers, biased MoE with a clamped SwiGLU, YaRN",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=(r"model\.rotary_emb\.inv_freq",),
    ),
]
