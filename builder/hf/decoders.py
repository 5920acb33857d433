"""Decoder-only Hugging Face families: GPT-2, and the Llama layout (Llama 1-3, Mistral, Mixtral,
Qwen2, Gemma, Gemma 2).

The Llama-layout families differ only in data (:class:`LlamaKnobs`): which biases exist, whether
the FFN is a mixture of experts, how sliding windows are declared, Gemma's scaled embeddings
and unit-offset norms, Gemma 2's sandwich norms, softcaps and ``query_pre_attn_scalar``. One
table reads and writes all six; a new Llama-layout family is one ``_llama(...)`` entry in
:data:`FAMILIES` (plus knobs for what differs).
"""

from __future__ import annotations

from dataclasses import dataclass

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import (
    Family,
    Link,
    Unsupported,
    activation_from_hf,
    activation_to_hf,
    decoder_links,
    dropout,
    need,
    rope_from_hf,
    rope_to_hf,
    same,
    split,
    stacked,
    transposed,
    window_overrides,
    windows_by_layer,
)

# --- GPT-2 -------------------------------------------------------------------------------


class GPT2(Family):
    def to_spec(self, config: dict, names: set[str]) -> dict:
        d, n_heads = need(config, "n_embd", "gpt2"), need(config, "n_head", "gpt2")
        n_layers, n_positions = need(config, "n_layer", "gpt2"), config.get("n_positions", 1024)
        head_dim = d // n_heads
        scale = None if config.get("scale_attn_weights", True) else 1.0
        overrides = []
        if config.get("scale_attn_by_inverse_layer_idx", False):
            # HF divides the scores by (layer index + 1) on top of 1/sqrt(head_dim)
            base = (head_dim**-0.5) if scale is None else 1.0
            overrides = [{"layers": [i], "attention": {"scale": base / (i + 1)}} for i in range(1, n_layers)]
        attn_dropout = dropout(config.get("attn_pdrop"))
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", "gpt2"),
            "d_model": d,
            "max_seq_len": n_positions,
            "tie_embeddings": config.get("tie_word_embeddings", True),
            "embedding": {"dropout": dropout(config.get("embd_pdrop"))},
            "position": {"type": "learned", "max_positions": n_positions},
            "decoder": {
                "n_layers": n_layers,
                "attention": {
                    "n_heads": n_heads,
                    "qkv_bias": True,
                    "out_bias": True,
                    "scale": scale,
                    "dropout": attn_dropout,
                },
                "ffn": {
                    "type": "mlp",
                    "activation": activation_from_hf(config.get("activation_function", "gelu_new"), "gpt2"),
                    "hidden_dim": config.get("n_inner") or 4 * d,
                    "bias": True,
                },
                "norm": {"type": "layernorm", "eps": config.get("layer_norm_epsilon", 1e-5), "placement": "pre"},
                "final_norm": True,
                "dropout": dropout(config.get("resid_pdrop")),
                "overrides": overrides,
            },
            "head": {"type": "lm", "bias": False},
        }

    def to_config(self, spec) -> dict:
        stack = spec.decoder
        attn = stack.attention
        if spec.position.type != "learned":
            raise Unsupported(f"position.type is {spec.position.type!r}; gpt2 uses learned positions")
        # GPT-2 scales scores by 1/sqrt(head_dim) or by 1 (scale_attn_weights), optionally divided
        # by (layer index + 1); any other pattern fails export's round-trip check and is reported
        by_layer = [stack.layer(i).attention.scale for i in range(stack.n_layers)]
        inverse = any(scale != by_layer[0] for scale in by_layer)
        return {
            "vocab_size": spec.vocab_size,
            "n_embd": spec.d_model,
            "n_layer": stack.n_layers,
            "n_head": attn.n_heads,
            "n_positions": spec.position.max_positions or spec.max_seq_len,
            # the older name of n_positions, which llama.cpp's converter reads
            "n_ctx": spec.position.max_positions or spec.max_seq_len,
            "n_inner": stack.ffn.resolved_hidden_dim(spec.d_model) if stack.ffn.type == "mlp" else None,
            "activation_function": activation_to_hf(getattr(stack.ffn, "activation", "gelu"), "gelu_new"),
            "layer_norm_epsilon": stack.norm.eps,
            "scale_attn_weights": attn.scale is None,
            "scale_attn_by_inverse_layer_idx": inverse,
            "tie_word_embeddings": spec.tie_embeddings,
            "embd_pdrop": spec.embedding.dropout,
            "attn_pdrop": attn.dropout,
            "resid_pdrop": stack.dropout,
        }

    def links(self, spec) -> list[Link]:
        d = spec.d_model

        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            qkv = [f"{attn}.{p}_proj" for p in "qkv"]
            links = [
                split(f"{h}.attn.c_attn.weight", [f"{p}.weight" for p in qkv], [d, d, d], transpose=True),
                split(f"{h}.attn.c_attn.bias", [f"{p}.bias" for p in qkv], [d, d, d]),
                transposed(f"{h}.attn.c_proj.weight", f"{attn}.out_proj.weight"),
                same(f"{h}.attn.c_proj.bias", f"{attn}.out_proj.bias"),
                transposed(f"{h}.mlp.c_fc.weight", f"{ffn}.up_proj.weight"),
                same(f"{h}.mlp.c_fc.bias", f"{ffn}.up_proj.bias"),
                transposed(f"{h}.mlp.c_proj.weight", f"{ffn}.down_proj.weight"),
                same(f"{h}.mlp.c_proj.bias", f"{ffn}.down_proj.bias"),
            ]
            for hf_norm, which in (("ln_1", "attention"), ("ln_2", "ffn")):
                links += [
                    same(f"{h}.{hf_norm}.{p}", f"{ours.layer_norm('decoder', i, which)}.{p}")
                    for p in ("weight", "bias")
                ]
            return links

        norm = [f"transformer.ln_f.{p}" for p in ("weight", "bias")]
        links = decoder_links(
            spec, layer_links, embedding="transformer.wte.weight", final_norm=norm, layers="transformer.h"
        )
        links.insert(1, same("transformer.wpe.weight", ours.learned_positions("decoder")))  # after the embedding
        return links


# --- the Llama layout --------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaKnobs:
    """How one Llama-layout family differs from Llama's own config and modules."""

    default_theta: float = 10000.0
    default_tie: bool = False
    attention_bias_key: bool = False  # config `attention_bias`: biases on q, k, v and o
    mlp_bias_key: bool = False  # config `mlp_bias`: biases on gate, up and down
    qkv_bias: bool = False  # q, k and v always biased, o never (Qwen2)
    #: "none": no window; "uniform": `sliding_window` on every layer; "layer_types": per layer
    windows: str = "none"
    #: "layer_types" without the list (older configs): "max_window_layers" (Qwen2: the layers from
    #: there on slide, when `use_sliding_window`) | "alternate" (Gemma 2: even layers slide)
    default_layer_types: str = "max_window_layers"
    moe: bool = False
    gemma: bool = False  # embeddings times sqrt(d_model) and RMSNorm scaled by (1 + weight)
    #: Gemma 2: pre and post norms around attention and MLP (four per layer), tanh softcaps on
    #: the attention scores and the logits, scores scaled by `query_pre_attn_scalar`**-0.5
    gemma2: bool = False
    activation_key: str = "hidden_act"  # the config key the MLP reads its activation from
    activation_aliases: tuple[tuple[str, str], ...] = ()


def attention_links(h: str, attn: str, config, qk_norms: bool = False) -> list[Link]:
    """A Llama-layout attention's tensors (``h``: Hugging Face's ``...self_attn``, ``attn``: ours),
    its biases where ``config`` has them, and with ``qk_norms`` its q/k norms' weights (``q_norm``,
    ``k_norm`` on both sides; an L2 norm has none): a family without them writes none, so a spec
    with q/k norms fails export there instead of losing them."""
    links = []
    for p in "qkv":
        links.append(same(f"{h}.{p}_proj.weight", f"{attn}.{p}_proj.weight"))
        if config.qkv_bias:
            links.append(same(f"{h}.{p}_proj.bias", f"{attn}.{p}_proj.bias"))
    links.append(same(f"{h}.o_proj.weight", f"{attn}.out_proj.weight"))
    if config.out_bias:
        links.append(same(f"{h}.o_proj.bias", f"{attn}.out_proj.bias"))
    if qk_norms and config.qk_norm is not None and config.qk_norm.type != "l2":
        links += [same(f"{h}.{p}_norm.weight", f"{attn}.{p}_norm.weight") for p in "qk"]
    return links


class LlamaLayout(Family):
    def __init__(self, knobs: LlamaKnobs, **kwargs):
        super().__init__(**kwargs)
        self.knobs = knobs

    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        k, family = self.knobs, self.model_type
        d = need(config, "hidden_size", family)
        n_heads = need(config, "num_attention_heads", family)
        head_dim = config.get("head_dim") or d // n_heads
        n_layers = need(config, "num_hidden_layers", family)
        attention = {
            "n_heads": n_heads,
            "n_kv_heads": config.get("num_key_value_heads") or n_heads,
            "head_dim": head_dim,
            "dropout": dropout(config.get("attention_dropout")),
        }
        mlp_bias = bool(config.get("mlp_bias", False)) if k.mlp_bias_key else False
        if k.attention_bias_key:
            attention["qkv_bias"] = attention["out_bias"] = bool(config.get("attention_bias", False))
        attention["qkv_bias"] = attention.get("qkv_bias", False) or k.qkv_bias
        act = activation_from_hf(
            config.get(k.activation_key) or config.get("hidden_act") or config.get("hidden_activation") or "silu",
            family,
            dict(k.activation_aliases),
        )
        dense = {
            "type": "glu",
            "activation": act,
            "hidden_dim": need(config, "intermediate_size", family),
            "bias": mlp_bias,
        }
        if k.moe:
            if config.get("router_jitter_noise"):
                raise Unsupported(f"{family}: router_jitter_noise > 0 has no counterpart here")
            ffn = {
                "type": "moe",
                "n_experts": need(config, "num_local_experts", family),
                "top_k": config.get("num_experts_per_tok", 2),
                "expert": dense,
            }
        else:
            ffn = dense
        stack = {
            "n_layers": n_layers,
            "attention": attention,
            "ffn": ffn,
            "norm": {"type": "rmsnorm", "eps": config.get("rms_norm_eps", 1e-6), "placement": "pre"},
            "final_norm": True,
        }
        if k.gemma:
            stack["norm"]["unit_offset"] = True
        head = {"type": "lm", "bias": False}
        if k.gemma2:
            if config.get("use_bidirectional_attention"):
                raise Unsupported(f"{family}: use_bidirectional_attention (an encoder) has no counterpart here")
            stack["norm"]["placement"] = "sandwich"
            attention["softcap"] = config.get("attn_logit_softcapping")
            head["softcap"] = config.get("final_logit_softcapping")
            scalar = config.get("query_pre_attn_scalar", 256)
            attention["scale"] = None if scalar == head_dim else float(scalar) ** -0.5
        window, overrides = window_overrides(self._windows(config, n_layers))
        attention["sliding_window"] = window
        if overrides:
            stack["overrides"] = overrides
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", family),
            "d_model": d,
            "max_seq_len": config.get("max_position_embeddings", 2048),
            "tie_embeddings": config.get("tie_word_embeddings", k.default_tie),
            "embedding": {"scale": "sqrt_d", "scale_in_model_dtype": True} if k.gemma else {"scale": "none"},
            "position": rope_from_hf(config, k.default_theta, head_dim),
            "decoder": stack,
            "head": head,
        }

    def _windows(self, config: dict, n_layers: int) -> list[int | None]:
        mode, window = self.knobs.windows, config.get("sliding_window")
        if mode == "none":
            return [None] * n_layers
        if mode == "uniform":
            if config.get("layer_types"):
                raise Unsupported(f"{self.model_type}: per-layer layer_types are not read for this family")
            return [window] * n_layers
        types = config.get("layer_types")
        if self.knobs.default_layer_types == "alternate":  # Gemma 2 (4.x: no layer_types)
            types = types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        elif not config.get("use_sliding_window", False):
            window = None
        if not types:  # transformers 4.x Qwen2: the layers from max_window_layers on slide
            start = config.get("max_window_layers", 28)
            types = ["sliding_attention" if window and i >= start else "full_attention" for i in range(n_layers)]
        if len(types) != n_layers:
            raise Unsupported(f"{self.model_type}: layer_types has {len(types)} entries for {n_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise Unsupported(f"{self.model_type}: layer types {sorted(unknown)} are not supported")
        return [window if t == "sliding_attention" else None for t in types]

    # spec -> config.json
    def to_config(self, spec) -> dict:
        k, stack = self.knobs, spec.decoder
        attn, ffn = stack.attention, stack.ffn
        expert = ffn.expert if ffn.type == "moe" else ffn
        config = {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.d_model,
            "intermediate_size": expert.resolved_hidden_dim(spec.d_model),
            "num_hidden_layers": stack.n_layers,
            "num_attention_heads": attn.n_heads,
            "num_key_value_heads": attn.n_kv_heads,
            "head_dim": attn.resolved_head_dim(spec.d_model),
            k.activation_key: activation_to_hf(getattr(expert, "activation", "silu"), "gelu_pytorch_tanh"),
            "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": stack.norm.eps,
            "tie_word_embeddings": spec.tie_embeddings,
            "attention_dropout": attn.dropout,
            **rope_to_hf(spec.position),
        }
        if k.attention_bias_key:
            config["attention_bias"] = attn.qkv_bias
        if k.mlp_bias_key:
            config["mlp_bias"] = expert.bias
        if k.moe:
            config.update(
                num_local_experts=getattr(ffn, "n_experts", None), num_experts_per_tok=getattr(ffn, "top_k", None)
            )
            config["router_jitter_noise"] = 0.0
        windows = windows_by_layer(stack)
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            raise Unsupported(f"{self.model_type} takes one sliding_window size; the spec has {sorted(sizes)}")
        window = sizes.pop() if sizes else None
        if k.windows == "uniform":
            config["sliding_window"] = windows[0]  # a mixed pattern fails the round-trip check
        elif k.windows == "layer_types":
            config.update(
                sliding_window=window, layer_types=["sliding_attention" if w else "full_attention" for w in windows]
            )
            if k.default_layer_types == "max_window_layers":
                config.update(use_sliding_window=window is not None, max_window_layers=stack.n_layers)
        if k.gemma2:
            config.update(
                attn_logit_softcapping=attn.softcap,
                final_logit_softcapping=spec.head.softcap,
                query_pre_attn_scalar=_query_pre_attn_scalar(attn.scale, config["head_dim"]),
            )
        return config

    # tensor names
    def links(self, spec) -> list[Link]:
        k = self.knobs

        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            links = attention_links(f"{h}.self_attn", attn, layer.attention)
            norms = {"input_layernorm": ("attention", False), "post_attention_layernorm": ("ffn", False)}
            if k.gemma2:  # sandwich: the post-attention norm closes attention; the FFN has its own two
                norms.update(
                    post_attention_layernorm=("attention", True),
                    pre_feedforward_layernorm=("ffn", False),
                    post_feedforward_layernorm=("ffn", True),
                )
            for hf_norm, (sublayer, post) in norms.items():
                links.append(same(f"{h}.{hf_norm}.weight", ours.layer_norm("decoder", i, sublayer, post) + ".weight"))
            if k.moe:
                moe = f"{h}.block_sparse_moe"
                links.append(same(f"{moe}.gate.weight", f"{ffn}.router.weight"))
                for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up")):  # ours: stacked
                    per_expert = [f"{moe}.experts.{e}.{w}.weight" for e in range(layer.ffn.n_experts)]
                    links.append(stacked(per_expert, f"{ffn}.experts.{p}_proj.weight"))
            else:
                for p in ("gate", "up", "down"):
                    links.append(same(f"{h}.mlp.{p}_proj.weight", f"{ffn}.{p}_proj.weight"))
                    if layer.ffn.bias:
                        links.append(same(f"{h}.mlp.{p}_proj.bias", f"{ffn}.{p}_proj.bias"))
            return links

        return decoder_links(spec, layer_links)


def fused_experts(spec) -> list[Link]:
    """transformers 5.x's in-memory Mixtral layout (3-D ``gate_up_proj`` and ``down_proj``), as a
    checkpoint saved from its state dict holds it; read as an alternative on import."""
    stack, links = spec.decoder, []
    for i in range(stack.n_layers):
        ffn = ours.ffn("decoder", i)
        hidden = stack.layer(i).ffn.expert.resolved_hidden_dim(spec.d_model)
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = [f"{ffn}.experts.gate_proj.weight", f"{ffn}.experts.up_proj.weight"]
        links += [
            split(f"{experts}.gate_up_proj", gate_up, [hidden, hidden], dim=1),  # (n_experts, 2 * hidden, d_model)
            same(f"{experts}.down_proj", f"{ffn}.experts.down_proj.weight"),
            same(f"model.layers.{i}.mlp.gate.weight", f"{ffn}.router.weight"),
        ]
    return links


def _query_pre_attn_scalar(scale: float | None, head_dim: int) -> int:
    """Gemma 2 scales scores by ``query_pre_attn_scalar ** -0.5``, an integer in its config."""
    if scale is None:
        return head_dim
    scalar = scale**-2
    if abs(scalar - round(scalar)) > 1e-6 * scalar:
        raise Unsupported(f"attention.scale {scale} is not 1/sqrt of an integer (gemma2's query_pre_attn_scalar)")
    return round(scalar)


_ROTARY = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


def _llama(model_type: str, hf_class: str, description: str, knobs: LlamaKnobs) -> LlamaLayout:
    return LlamaLayout(
        knobs,
        model_type=model_type,
        hf_class=hf_class,
        auto_class="AutoModelForCausalLM",
        description=description,
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=_ROTARY,
        alternative_links=fused_experts if knobs.moe else None,
    )


FAMILIES = [
    GPT2(
        model_type="gpt2",
        hf_class="GPT2LMHeadModel",
        auto_class="AutoModelForCausalLM",
        description="GPT-2: learned positions, fused Conv1D projections, pre-LayerNorm, tied head",
        tied=("lm_head.weight", "transformer.wte.weight"),
        ignored=(r"transformer\.h\.\d+\.attn\.(masked_)?bias",),
    ),
    _llama(
        "llama",
        "LlamaForCausalLM",
        "Llama 1-3: RoPE (llama3 scaling), SwiGLU, RMSNorm, GQA",
        LlamaKnobs(attention_bias_key=True, mlp_bias_key=True),
    ),
    _llama("mistral", "MistralForCausalLM", "Mistral: Llama with a sliding window", LlamaKnobs(windows="uniform")),
    _llama(
        "mixtral",
        "MixtralForCausalLM",
        "Mixtral: Mistral with a top-k mixture of SwiGLU experts",
        LlamaKnobs(default_theta=1e6, windows="uniform", moe=True),
    ),
    _llama(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2: Llama with q/k/v biases and per-layer sliding windows",
        LlamaKnobs(qkv_bias=True, windows="layer_types"),
    ),
    _llama(
        "gemma",
        "GemmaForCausalLM",
        "Gemma: GeGLU, sqrt(d_model)-scaled embeddings, RMSNorm(1 + w), tied head",
        LlamaKnobs(
            default_tie=True, attention_bias_key=True, gemma=True, activation_aliases=(("gelu", "gelu_pytorch_tanh"),)
        ),
    ),
    _llama(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma 2: Gemma with sandwich norms, attention and logit softcaps, alternating sliding windows",
        LlamaKnobs(
            default_tie=True,
            attention_bias_key=True,
            gemma=True,
            gemma2=True,
            windows="layer_types",
            default_layer_types="alternate",
            activation_key="hidden_activation",
        ),
    ),
]
