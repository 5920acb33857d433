"""OLMo 2 (``olmo2``, transformers' ``Olmo2ForCausalLM``): the Llama layout with its norms after
each sub-layer and an RMSNorm over the whole query and key projections.

Each layer computes ``h = x + norm(attn(x))``, then ``h + norm(mlp(h))`` (``norm.placement:
post_sublayer`` here; ``post_attention_layernorm`` is our ``attention_norm``,
``post_feedforward_layernorm`` our ``ffn_norm``), and the final norm closes the stack. ``q_norm``
is one RMSNorm over the ``num_attention_heads * head_dim`` query projection and ``k_norm`` one over
the ``num_key_value_heads * head_dim`` key projection, before RoPE, with the model's
``rms_norm_eps`` (``attention.qk_norm: {type: rmsnorm, over: projection}``). ``attention_bias``
puts biases on q, k, v and o; the MLP has none. Export writes null token ids: ``Olmo2Config``
defaults its end-of-text id to 50279, outside a small vocabulary.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import Link, decoder_links, same
from yamlformer.builder.hf.decoders import _ROTARY, LlamaKnobs, attention_links
from yamlformer.builder.hf.qwen import ClassDefaults, dense_links


class Olmo2(ClassDefaults):
    # config.json -> spec: the Llama layout's, the norms after the sub-layers, the q/k norms
    def to_spec(self, config: dict, names: set[str]) -> dict:
        spec = super().to_spec(config, names)
        stack = spec["decoder"]
        stack["norm"]["placement"] = "post_sublayer"
        stack["attention"]["qk_norm"] = {"type": "rmsnorm", "over": "projection", "eps": stack["norm"]["eps"]}
        return spec

    # spec -> config.json
    def to_config(self, spec) -> dict:
        return {**super().to_config(spec), "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

    # tensor names
    def links(self, spec) -> list[Link]:
        def layer_links(h: str, i: int, layer) -> list[Link]:
            return [
                *attention_links(f"{h}.self_attn", ours.attention("decoder", i), layer.attention, qk_norms=True),
                *dense_links(f"{h}.mlp", ours.ffn("decoder", i)),
                same(f"{h}.post_attention_layernorm.weight", ours.layer_norm("decoder", i, "attention") + ".weight"),
                same(f"{h}.post_feedforward_layernorm.weight", ours.layer_norm("decoder", i, "ffn") + ".weight"),
            ]

        return decoder_links(spec, layer_links)


FAMILIES = [
    Olmo2(
        LlamaKnobs(attention_bias_key=True),
        {"rms_norm_eps": 1e-5},
        model_type="olmo2",
        hf_class="Olmo2ForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="OLMo 2: norms after each sub-layer, RMSNorm over the whole q and k projections",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=_ROTARY,
    ),
]
