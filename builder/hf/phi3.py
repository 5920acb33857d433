"""Phi-3 (``phi3``, transformers' ``Phi3ForCausalLM``): the Llama layout with two fused weights.

Phi-3 computes what Mistral does (RoPE, SwiGLU, RMSNorm, GQA, one ``sliding_window`` on every
layer, no biases) but stores q, k and v as one ``qkv_proj`` (rows: the queries, then the keys,
then the values) and the FFN's gate and up projections as one ``gate_up_proj`` (rows: gate,
then up: ``Phi3MLP`` chunks its output in two and gates the first half). Import splits them
into our separate projections; export concatenates them back.

Read as transformers reads them: ``resid_pdrop`` is the dropout on both residual branches;
``embd_pdrop`` is in ``Phi3Config`` but ``Phi3Model`` never applies it, so it is not read.
``rope_parameters`` of type ``longrope`` (Phi-3's 128k-context checkpoints: per-frequency
short and long factors switched by the sequence length at run time) has no counterpart here
and is refused, as every family refuses a rope type it cannot state exactly. Export writes
null token ids: ``Phi3Config`` defaults them to 1 and 32000, which lie outside a small
vocabulary (a tokenizer's or ``--hf-config``'s ids replace them).
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import Link, decoder_links, dropout, same, split
from yamlformer.builder.hf.decoders import _ROTARY, LlamaKnobs
from yamlformer.builder.hf.qwen import ClassDefaults


class Phi3(ClassDefaults):
    # config.json -> spec: Mistral's, with the residual dropout
    def to_spec(self, config: dict, names: set[str]) -> dict:
        spec = super().to_spec(config, names)
        spec["decoder"]["dropout"] = dropout(config.get("resid_pdrop"))
        return spec

    # spec -> config.json
    def to_config(self, spec) -> dict:
        config = super().to_config(spec)
        config.update(resid_pdrop=spec.decoder.dropout, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return config

    # tensor names
    def links(self, spec) -> list[Link]:
        d = spec.d_model

        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            head_dim = layer.attention.resolved_head_dim(d)
            q, kv = layer.attention.n_heads * head_dim, layer.attention.n_kv_heads * head_dim
            hidden = layer.ffn.resolved_hidden_dim(d)
            return [
                split(f"{h}.self_attn.qkv_proj.weight", [f"{attn}.{p}_proj.weight" for p in "qkv"], [q, kv, kv]),
                same(f"{h}.self_attn.o_proj.weight", f"{attn}.out_proj.weight"),
                same(f"{h}.input_layernorm.weight", ours.layer_norm("decoder", i, "attention") + ".weight"),
                same(f"{h}.post_attention_layernorm.weight", ours.layer_norm("decoder", i, "ffn") + ".weight"),
                split(
                    f"{h}.mlp.gate_up_proj.weight", [f"{ffn}.gate_proj.weight", f"{ffn}.up_proj.weight"], [hidden] * 2
                ),
                same(f"{h}.mlp.down_proj.weight", f"{ffn}.down_proj.weight"),
            ]

        return decoder_links(spec, layer_links)


FAMILIES = [
    Phi3(
        LlamaKnobs(windows="uniform"),
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
        model_type="phi3",
        hf_class="Phi3ForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="Phi-3: Mistral's layout with a fused qkv_proj and gate_up_proj",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=_ROTARY,
    ),
]
