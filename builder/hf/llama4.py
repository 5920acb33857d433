"""Llama 4's text model (``llama4_text``, transformers' ``Llama4ForCausalLM``).

Each layer is one of two kinds, and each kind's mechanisms are spec fields of its layers:

- RoPE layers (``no_rope_layers[i] == 1``): attention inside chunks of ``attention_chunk_size``
  tokens (``attention.chunk_size``; ``layer_types`` says which layers are chunked), and with
  ``use_qk_norm`` a weightless L2 norm on q and k with ``rms_norm_eps``
  (``attention.qk_norm: {type: l2}``; transformers applies it after RoPE, which it commutes with);
- NoPE layers (every ``no_rope_layer_interval``-th by default): no rotation (``attention.rope:
  false``), the whole context, and with ``attn_temperature_tuning`` queries times
  ``log(floor((position + 1) / floor_scale) + 1) * attn_scale + 1``
  (``attention.temperature_tuning``).

The FFN of the ``moe_layers`` (every ``interleave_moe_layer_step``-th) is ``deepseek_moe`` with
Llama 4's routing: top-k of the router's logits, a sigmoid of each, multiplying the expert's
input (``weight_on: input``), plus one shared expert as wide as a routed one; the other layers
are a SwiGLU ``intermediate_size_mlp`` wide. The routed experts are fused on disk:
``gate_up_proj`` ``(n_experts, d_model, 2 * hidden)``, gate then up, and ``down_proj``
``(n_experts, hidden, d_model)``, both transposed against our stacked ``(n_experts, out, in)``.

transformers rotates pairs of dimensions as complex numbers (interleaved); our RoPE rotates
halves, so on the RoPE layers the rows of each head of ``q_proj`` and ``k_proj`` (weights and
biases) are permuted on import and back on export, which leaves every score unchanged (the L2
norm spans the whole head, so it is unchanged too). Under left padding transformers' chunks
start at a row's first real token and its temperature counts token indices, where ours go by
token index and by position id: the two agree on unpadded and right-padded rows.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import (
    Family,
    HFError,
    Link,
    Unsupported,
    activation_from_hf,
    activation_to_hf,
    decoder_links,
    dropout,
    need,
    permuted_rows,
    rope_from_hf,
    rope_to_hf,
    same,
)
from yamlformer.builder.hf.layered import (
    flags,
    indices,
    layer_types,
    layer_values,
    stack_overrides,
    uniform,
    whole_head_rope,
)

#: transformers' Llama4TextConfig defaults for the keys a config may leave out
DEFAULTS = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size_mlp": 16384,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096 * 32,
    "hidden_act": "silu",
}
LAYER_TYPES = ("chunked_attention", "full_attention")


class Llama4(Family):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        family = self.model_type
        config = {**DEFAULTS, **config}
        d, n_heads = need(config, "hidden_size", family), need(config, "num_attention_heads", family)
        n_layers = need(config, "num_hidden_layers", family)
        head_dim = config.get("head_dim") or d // n_heads
        tuning = config.get("attn_temperature_tuning")
        if type(tuning) not in (bool, int):  # transformers tests its truth (Scout's config says 4)
            raise HFError(f"attn_temperature_tuning: expected true, false or an integer, got {tuning!r}")
        interval = config["no_rope_layer_interval"]
        rope = flags(config, "no_rope_layers", n_layers, family) or [
            int((i + 1) % interval != 0) for i in range(n_layers)
        ]
        chunk = config.get("attention_chunk_size")
        types = layer_types(config, n_layers, LAYER_TYPES, family) or [
            "chunked_attention" if r and chunk is not None else "full_attention" for r in rope
        ]
        if "chunked_attention" in types and chunk is None:
            raise HFError("layer_types names chunked_attention layers, but attention_chunk_size is null")
        step = config["interleave_moe_layer_step"]
        moe_layers = indices(config, "moe_layers", n_layers)
        moe_layers = set(range(step - 1, n_layers, step) if moe_layers is None else moe_layers)
        eps = config["rms_norm_eps"]
        temperature = {"floor_scale": config["floor_scale"], "scale": float(config["attn_scale"])}
        act = activation_from_hf(config["hidden_act"], family)
        expert = {"type": "glu", "activation": act, "hidden_dim": need(config, "intermediate_size", family)}
        moe = {
            "type": "deepseek_moe",
            "n_experts": need(config, "num_local_experts", family),
            "top_k": need(config, "num_experts_per_tok", family),
            "n_shared_experts": 1,
            "scoring": "sigmoid",
            "weight_on": "input",
            "expert": expert,
        }
        dense = {"type": "glu", "activation": act, "hidden_dim": need(config, "intermediate_size_mlp", family)}
        layers = [
            {
                "attention": {
                    "rope": bool(rope[i]),
                    "chunk_size": chunk if types[i] == "chunked_attention" else None,
                    "qk_norm": {"type": "l2", "eps": eps} if rope[i] and config["use_qk_norm"] else None,
                    "temperature_tuning": temperature if tuning and not rope[i] else None,
                },
                "ffn": moe if i in moe_layers else dense,
            }
            for i in range(n_layers)
        ]
        base, overrides = stack_overrides(layers)
        bias = bool(config["attention_bias"])
        stack = {
            "n_layers": n_layers,
            "attention": {
                "n_heads": n_heads,
                "n_kv_heads": config.get("num_key_value_heads") or n_heads,
                "head_dim": head_dim,
                "qkv_bias": bias,
                "out_bias": bias,
                "dropout": dropout(config.get("attention_dropout")),
                **base["attention"],
            },
            "ffn": base["ffn"],
            "norm": {"type": "rmsnorm", "eps": eps, "placement": "pre"},
            "final_norm": True,
        }
        if overrides:
            stack["overrides"] = overrides
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", family),
            "d_model": d,
            "max_seq_len": config["max_position_embeddings"],
            "tie_embeddings": config.get("tie_word_embeddings", False),
            "embedding": {"scale": "none"},
            "position": whole_head_rope(rope_from_hf(config, 500000.0, head_dim), family),
            "decoder": stack,
            "head": {"type": "lm", "bias": False},
        }

    # spec -> config.json
    def to_config(self, spec) -> dict:
        stack, family = spec.decoder, self.model_type
        attn = stack.attention
        if attn.type != "multi_head":
            raise Unsupported(f"decoder.attention is {attn.type!r}; {family} uses multi_head")
        attentions = layer_values(stack, lambda layer: layer.attention)
        ffns = layer_values(stack, lambda layer: layer.ffn)
        moe_layers = [i for i, f in enumerate(ffns) if f.type == "deepseek_moe"]
        # one MoE and one dense FFN for all their layers (as the config has), read from the first of each
        moe = next((f for f in ffns if f.type == "deepseek_moe"), None)
        dense = next((f for f in ffns if f.type != "deepseek_moe"), None)
        uniform([f.model_dump(mode="json") for f in ffns if f.type == "deepseek_moe"], "MoE FFN", family)
        uniform([f.model_dump(mode="json") for f in ffns if f.type != "deepseek_moe"], "dense FFN", family)
        norm = uniform([a.qk_norm.model_dump(mode="json") for a in attentions if a.qk_norm], "qk_norm", family)
        tuning = uniform(
            [a.temperature_tuning.model_dump(mode="json") for a in attentions if a.temperature_tuning],
            "temperature_tuning",
            family,
        )
        chunk = uniform([a.chunk_size for a in attentions], "chunk_size (attention_chunk_size)", family)
        expert = moe.expert if moe is not None else dense
        d = spec.d_model
        position = rope_to_hf(spec.position)
        theta, scaling = position.pop("rope_theta"), position.pop("rope_scaling")
        config = {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.d_model,
            "num_hidden_layers": stack.n_layers,
            "num_attention_heads": attn.n_heads,
            "num_key_value_heads": attn.n_kv_heads,
            "head_dim": attn.resolved_head_dim(spec.d_model),
            "hidden_act": activation_to_hf(getattr(expert, "activation", "silu"), "gelu_pytorch_tanh"),
            # a size no layer uses is written as 1 (every layer dense, or every layer MoE)
            "intermediate_size": moe.expert.resolved_hidden_dim(d) if moe is not None else 1,
            "intermediate_size_mlp": _hidden(dense, d),
            "num_local_experts": moe.n_experts if moe is not None else 1,
            "num_experts_per_tok": moe.top_k if moe is not None else 1,
            "moe_layers": moe_layers,
            "interleave_moe_layer_step": 1,
            "no_rope_layers": [int(a.rope) for a in attentions],
            "attention_chunk_size": chunk,
            "layer_types": ["chunked_attention" if a.chunk_size else "full_attention" for a in attentions],
            "use_qk_norm": norm is not None,
            "attn_temperature_tuning": tuning is not None,
            "floor_scale": (tuning or {}).get("floor_scale", DEFAULTS["floor_scale"]),
            "attn_scale": (tuning or {}).get("scale", DEFAULTS["attn_scale"]),
            "attention_bias": attn.qkv_bias,
            "attention_dropout": attn.dropout,
            "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": stack.norm.eps,
            "tie_word_embeddings": spec.tie_embeddings,
            "router_jitter_noise": 0.0,
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta},
            **position,
        }
        return config

    # tensor names
    def links(self, spec) -> list[Link]:
        d = spec.d_model

        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            a, links = layer.attention, []
            hd = a.resolved_head_dim(d)
            for p, heads in (("q", a.n_heads), ("k", a.n_kv_heads), ("v", None)):
                for kind in ("weight", "bias") if a.qkv_bias else ("weight",):
                    hf, our = f"{h}.self_attn.{p}_proj.{kind}", f"{attn}.{p}_proj.{kind}"
                    # the rotated heads' rows: interleaved pairs on disk, halves here
                    links.append(permuted_rows(hf, our, heads, hd, 0, hd) if heads and a.rope else same(hf, our))
            links.append(same(f"{h}.self_attn.o_proj.weight", f"{attn}.out_proj.weight"))
            if a.out_bias:
                links.append(same(f"{h}.self_attn.o_proj.bias", f"{attn}.out_proj.bias"))
            links += [
                same(f"{h}.input_layernorm.weight", ours.layer_norm("decoder", i, "attention") + ".weight"),
                same(f"{h}.post_attention_layernorm.weight", ours.layer_norm("decoder", i, "ffn") + ".weight"),
            ]
            return links + _ffn_links(f"{h}.feed_forward", ffn, layer.ffn, d)

        return decoder_links(spec, layer_links)


def _hidden(ffn, d_model: int) -> int:
    """The dense layers' width: 1 without any (or for an FFN Llama 4 has not; export's comparison
    then names it)."""
    return ffn.resolved_hidden_dim(d_model) if ffn is not None and ffn.type in ("glu", "mlp") else 1


def _ffn_links(hf: str, ffn: str, config, d_model: int) -> list[Link]:
    if config.type != "deepseek_moe":
        return [same(f"{hf}.{p}_proj.weight", f"{ffn}.{p}_proj.weight") for p in ("gate", "up", "down")]
    hidden = config.expert.resolved_hidden_dim(d_model)
    links = [
        same(f"{hf}.router.weight", f"{ffn}.router.weight"),
        Link(
            (f"{hf}.experts.gate_up_proj",),
            (f"{ffn}.experts.gate_proj.weight", f"{ffn}.experts.up_proj.weight"),
            # (n_experts, d_model, 2 * hidden), gate then up -> two (n_experts, hidden, d_model)
            lambda ts: [p.transpose(1, 2).contiguous() for p in ts[0].split(hidden, dim=2)],
            lambda ts: [_cat_transposed(ts)],
        ),
        Link(
            (f"{hf}.experts.down_proj",),
            (f"{ffn}.experts.down_proj.weight",),
            lambda ts: [ts[0].transpose(1, 2).contiguous()],
            lambda ts: [ts[0].transpose(1, 2).contiguous()],
        ),
    ]
    links += [
        same(f"{hf}.shared_expert.{p}_proj.weight", f"{ffn}.shared_experts.{p}_proj.weight")
        for p in ("gate", "up", "down")
    ]
    return links


def _cat_transposed(ts):
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    return torch.cat([t.transpose(1, 2) for t in ts], dim=2).contiguous()


FAMILIES = [
    Llama4(
        model_type="llama4_text",
        hf_class="Llama4ForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="Llama 4 (text): chunked RoPE layers with an L2 QK-norm, NoPE layers with temperature "
        "tuning, top-1 sigmoid MoE with a shared expert",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=(r"model\.rotary_emb\.inv_freq",),
    ),
]
