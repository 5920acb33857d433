"""Gemma 3's text model (``gemma3_text``, transformers' ``Gemma3ForCausalLM``).

Gemma 2's layout (:class:`yamlformer.builder.hf.decoders.LlamaLayout` with its Gemma knobs: sandwich
RMSNorm(1 + w), GeGLU, sqrt(d_model) embeddings in the model dtype, ``query_pre_attn_scalar``,
the final logits' softcap, which Gemma 3 leaves null; ``attn_logit_softcapping`` is refused, as
transformers' Gemma 3 stores it and never applies it) plus what Gemma 3 adds, each a spec field:

- a QK-norm, RMSNorm(1 + w) over each head's ``head_dim`` with ``rms_norm_eps``
  (``attention.qk_norm: {type: rmsnorm, over: head, unit_offset: true}``; ``q_norm``/``k_norm``);
- five local layers to one global (``layer_types``; configs without it: ``sliding_window_pattern``,
  6 by default, global where ``(i + 1) % pattern == 0``), the window on the local ones;
- two RoPE bases: ``rope_parameters.full_attention`` (with any scaling: 4B and up have linear 8)
  is the position block, ``sliding_attention`` (10,000, unscaled) the local layers'
  ``attention.rope_theta``. 4.x configs say ``rope_theta``, ``rope_scaling`` and
  ``rope_local_base_freq``; export writes both spellings.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.checks import check_config
from yamlformer.builder.hf.common import HFError, Link, Unsupported, need, rope_to_hf, same
from yamlformer.builder.hf.decoders import LlamaKnobs, LlamaLayout
from yamlformer.builder.hf.layered import layer_types, layer_values, stack_overrides, uniform, whole_head_rope

#: transformers' Gemma3TextConfig.default_theta
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
LAYER_TYPES = ("sliding_attention", "full_attention")
#: transformers' Gemma3TextConfig defaults for the keys the Llama reader defaults otherwise
DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
}


def _types(config: dict, n_layers: int) -> list[str]:
    types = layer_types(config, n_layers, LAYER_TYPES, "gemma3_text")
    if types is not None:
        return types
    pattern = config.get("sliding_window_pattern", 6)
    if type(pattern) is not int or pattern < 1:
        raise HFError(f"sliding_window_pattern: expected an integer from 1, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def _rope(config: dict) -> tuple[dict, dict]:
    """``(full_attention, sliding_attention)`` rope parameters, from either spelling."""
    nested = config.get("rope_parameters") or {}
    if nested and not set(nested) <= set(LAYER_TYPES):
        raise Unsupported("gemma3_text: rope_parameters must be keyed by sliding_attention and full_attention")
    if not all(isinstance(v, dict) for v in nested.values()):
        raise HFError("rope_parameters: expected a mapping for each of sliding_attention and full_attention")
    # as Gemma3TextConfig reads them: rope_scaling laid over the global layers' parameters
    full = {**(nested.get("full_attention") or {}), **(config.get("rope_scaling") or {})}
    full.setdefault("rope_theta", config.get("rope_theta", GLOBAL_THETA))
    local = {"rope_type": "default", **(nested.get("sliding_attention") or {})}
    local.setdefault("rope_theta", config.get("rope_local_base_freq", LOCAL_THETA))
    for part, params in (("full_attention", full), ("sliding_attention", local)):
        check_config(params, f"rope_parameters.{part}")  # the kinds check_config gives the flat spelling
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise Unsupported(
            "gemma3_text: rope scaling on the sliding (local) layers has no counterpart here: a layer's "
            "rope_theta rotates unscaled"
        )
    return full, local


class Gemma3(LlamaLayout):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        if config.get("attn_logit_softcapping") is not None:
            raise Unsupported(
                "gemma3_text: attn_logit_softcapping is set, and transformers' Gemma3ForCausalLM ignores it "
                "(its attention is passed no softcap); the model it computes has none"
            )
        config = {**DEFAULTS, **config}
        n_layers = need(config, "num_hidden_layers", self.model_type)
        types = _types(config, n_layers)
        full, local = _rope(config)
        # Gemma 2's reader on the global layers' rope and the explicit layer types
        spec = super().to_spec(
            {**config, "layer_types": types, "rope_parameters": full, "rope_scaling": None, "rope_theta": None},
            names,
        )
        stack, theta = spec["decoder"], whole_head_rope(spec["position"], self.model_type)["theta"]
        eps = stack["norm"]["eps"]
        stack["attention"]["qk_norm"] = {"type": "rmsnorm", "over": "head", "eps": eps, "unit_offset": True}
        window = config.get("sliding_window")
        local_theta = float(local["rope_theta"])
        layers = [
            {
                "attention": {
                    "sliding_window": window if t == "sliding_attention" else None,
                    "rope_theta": local_theta if t == "sliding_attention" and local_theta != theta else None,
                }
            }
            for t in types
        ]
        base, overrides = stack_overrides(layers)
        stack["attention"].update(base["attention"])
        stack.pop("overrides", None)
        if overrides:
            stack["overrides"] = overrides
        return spec

    # spec -> config.json
    def to_config(self, spec) -> dict:
        stack = spec.decoder
        config = super().to_config(spec)
        position = rope_to_hf(spec.position)
        scaling = position["rope_scaling"] or {"rope_type": "default"}
        windows = layer_values(stack, lambda layer: layer.attention.sliding_window)
        local = uniform(
            [layer.attention.rope_theta or spec.position.theta for layer, w in zip(stack.layers(), windows) if w],
            "local rope_theta (rope_local_base_freq)",
            self.model_type,
        )
        local = spec.position.theta if local is None else local
        config.update(
            rope_parameters={
                "full_attention": {**scaling, "rope_theta": spec.position.theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            },
            rope_local_base_freq=local,
        )
        config.pop("rope_scaling")  # 5.x would lay it over full_attention again; rope_parameters says it
        return config

    # tensor names
    def links(self, spec) -> list[Link]:
        links = super().links(spec)
        for i in range(spec.decoder.n_layers):
            norm = spec.decoder.layer(i).attention.qk_norm
            if norm is not None and norm.type == "rmsnorm":
                h, attn = f"model.layers.{i}.self_attn", ours.attention("decoder", i)
                links += [same(f"{h}.{p}_norm.weight", f"{attn}.{p}_norm.weight") for p in "qk"]
        return links


FAMILIES = [
    Gemma3(
        LlamaKnobs(
            default_theta=GLOBAL_THETA,
            default_tie=True,
            attention_bias_key=True,
            gemma=True,
            gemma2=True,
            windows="layer_types",
            default_layer_types="alternate",
            activation_key="hidden_activation",
        ),
        model_type="gemma3_text",
        hf_class="Gemma3ForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="Gemma 3 (text): Gemma 2 with a per-head QK-norm, 5:1 local:global layers, "
        "RoPE bases 10k local / 1M global",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=(r"model\.rotary_emb\.\w*inv_freq",),
    ),
]
