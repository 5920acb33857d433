"""Qwen3 (``qwen3``, ``Qwen3ForCausalLM``) and Qwen3-MoE (``qwen3_moe``, ``Qwen3MoeForCausalLM``):
the Llama layout with an RMSNorm over each query and key head before RoPE.

``q_norm`` and ``k_norm`` are one ``head_dim``-wide RMSNorm each, shared by the heads, with the
model's ``rms_norm_eps`` (``attention.qk_norm: {type: rmsnorm, over: head}`` here).
``attention_bias`` puts biases on q, k, v and o. Qwen3's sliding windows are Qwen2's
(``layer_types``, or the layers from ``max_window_layers`` on when ``use_sliding_window``);
Qwen3-MoE's one ``sliding_window`` covers every layer when ``use_sliding_window``.
A key a config leaves out takes its class's default, which is not always Llama's:
``Qwen3Config`` has ``head_dim`` 128 (``Qwen3MoeConfig`` has no such field, and its attention
falls back to ``hidden_size / num_attention_heads``) and ``num_key_value_heads`` 32,
``Qwen3MoeConfig`` ``num_key_value_heads`` 4.

Qwen3-MoE's sparse layers (those not in ``mlp_only_layers`` whose index + 1 is a multiple of
``decoder_sparse_step``; the others are dense SwiGLU layers of ``intermediate_size``) route each
token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts by a softmax over all the
experts, the chosen probabilities renormalised when ``norm_topk_prob``: the ``deepseek_moe``
block with softmax scoring, one group, no shared expert and the same ``norm_topk_prob`` (its
experts' weights stacked, so a 128-expert model builds in a blink). Checkpoints hold each
expert's ``gate_proj``, ``up_proj`` and ``down_proj`` (transformers 5.x's in-memory 3-D
``gate_up_proj`` and ``down_proj``, saved as they are, are read too); the router is ``mlp.gate``.
Training only (no inference difference): the block's auxiliary loss is DeepSeek's expert-level
balance loss, where transformers adds Switch's router loss (``router_aux_loss_coef``) only when
``output_router_logits``.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import Link, Unsupported, decoder_links, need, same, stacked
from yamlformer.builder.hf.decoders import _ROTARY, LlamaKnobs, LlamaLayout, attention_links

# the experts' per-expert and 3-D layouts are DeepSeek's (the same module names)
from yamlformer.builder.hf.deepseek import fused_experts


def dense_links(h: str, ffn: str) -> list[Link]:
    """A bias-free SwiGLU MLP's tensors (``h``: Hugging Face's ``...mlp``, ``ffn``: ours)."""
    return [same(f"{h}.{p}_proj.weight", f"{ffn}.{p}_proj.weight") for p in ("gate", "up", "down")]


class ClassDefaults(LlamaLayout):
    """A Llama-layout family whose config class defaults some keys otherwise than Llama's:
    ``defaults`` fills them in where a config.json leaves them out, as transformers does."""

    def __init__(self, knobs: LlamaKnobs, defaults: dict, **kwargs):
        super().__init__(knobs, **kwargs)
        self.defaults = defaults

    def to_spec(self, config: dict, names: set[str]) -> dict:
        return super().to_spec({**self.defaults, **config}, names)


class Qwen3(ClassDefaults):
    # config.json -> spec: the Llama layout's, with the q/k norms
    def to_spec(self, config: dict, names: set[str]) -> dict:
        spec = super().to_spec(config, names)
        eps = spec["decoder"]["norm"]["eps"]
        spec["decoder"]["attention"]["qk_norm"] = {"type": "rmsnorm", "over": "head", "eps": eps}
        return spec

    # spec -> config.json: the Llama layout's; the q/k norms' eps is rms_norm_eps (checked on the way back)

    # tensor names
    def links(self, spec) -> list[Link]:
        def layer_links(h: str, i: int, layer) -> list[Link]:
            return [
                *attention_links(f"{h}.self_attn", ours.attention("decoder", i), layer.attention, qk_norms=True),
                same(f"{h}.input_layernorm.weight", ours.layer_norm("decoder", i, "attention") + ".weight"),
                same(f"{h}.post_attention_layernorm.weight", ours.layer_norm("decoder", i, "ffn") + ".weight"),
                *self._ffn_links(f"{h}.mlp", ours.ffn("decoder", i), layer.ffn),
            ]

        return decoder_links(spec, layer_links)

    def _ffn_links(self, h: str, ffn: str, config) -> list[Link]:
        return dense_links(h, ffn)


#: the ffn type of Qwen3-MoE's sparse layers
SPARSE = "deepseek_moe"


class Qwen3Moe(Qwen3):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        family = self.model_type
        if config.get("router_jitter_noise"):
            raise Unsupported(f"{family}: router_jitter_noise > 0 has no counterpart here")
        if "num_experts" not in config and "num_local_experts" in config:  # to_dict's name for it
            config = {**config, "num_experts": config["num_local_experts"]}
        config = {**self.defaults, **config}
        windowed = {
            **config,
            "sliding_window": config.get("sliding_window") if config.get("use_sliding_window") else None,
        }
        spec = super().to_spec(windowed, names)
        stack, n_layers = spec["decoder"], spec["decoder"]["n_layers"]
        dense = stack["ffn"]
        expert = {**dense, "hidden_dim": need(config, "moe_intermediate_size", family)}
        n_experts = need(config, "num_experts", family)
        moe = {
            "type": SPARSE,
            "scoring": "softmax",
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "n_experts": n_experts,
            "top_k": need(config, "num_experts_per_tok", family),
            "expert": expert,
        }
        step = config.get("decoder_sparse_step") or 1
        only_dense = config.get("mlp_only_layers") or []
        if not isinstance(only_dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only_dense
        ):
            raise Unsupported(f"{family}: mlp_only_layers: expected a list of layer indices")
        sparse = [i not in only_dense and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        stack["ffn"] = moe if any(sparse) else dense
        overrides = [i for i, s in enumerate(sparse) if s != any(sparse)]
        if overrides:
            stack["overrides"] = stack.get("overrides", []) + [{"layers": overrides, "ffn": dense}]
        return spec

    # spec -> config.json
    def to_config(self, spec) -> dict:
        stack = spec.decoder
        ffns = [stack.layer(i).ffn for i in range(stack.n_layers)]
        sparse = [i for i, f in enumerate(ffns) if f.type == SPARSE]
        moe = ffns[sparse[0]] if sparse else None
        dense = next((f for f in ffns if f.type != SPARSE), None)
        if moe is None:
            raise Unsupported(f"no layer's ffn is {SPARSE}; {self.model_type} is a mixture of experts")
        # attention, norms and RoPE as Qwen3 writes them, from the spec with one dense FFN
        view = spec.model_copy(update={"decoder": stack.model_copy(update={"ffn": dense or moe.expert})})
        config = super().to_config(view)
        windows = {stack.layer(i).attention.sliding_window for i in range(stack.n_layers)}
        config.update(
            use_sliding_window=windows != {None},
            num_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert.resolved_hidden_dim(spec.d_model),
            norm_topk_prob=moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(stack.n_layers) if i not in sparse],
            router_jitter_noise=0.0,
        )
        return config

    def _ffn_links(self, h: str, ffn: str, config) -> list[Link]:
        if config.type != SPARSE:
            return dense_links(h, ffn)
        links = [same(f"{h}.gate.weight", f"{ffn}.router.weight")]
        for p in ("gate", "up", "down"):  # ours: the experts' weights stacked
            links.append(
                stacked(
                    [f"{h}.experts.{e}.{p}_proj.weight" for e in range(config.n_experts)],
                    f"{ffn}.experts.{p}_proj.weight",
                )
            )
        return links


FAMILIES = [
    Qwen3(
        LlamaKnobs(attention_bias_key=True, windows="layer_types"),
        {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768},
        model_type="qwen3",
        hf_class="Qwen3ForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="Qwen3: Qwen2 with an RMSNorm over each query and key head, no q/k/v biases",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=_ROTARY,
    ),
    Qwen3Moe(
        LlamaKnobs(attention_bias_key=True, windows="uniform"),
        {
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
        },
        model_type="qwen3_moe",
        hf_class="Qwen3MoeForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="Qwen3-MoE: Qwen3 with softmax top-k SwiGLU experts (renormalised with norm_topk_prob)",
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        ignored=_ROTARY,
        alternative_links=fused_experts,
    ),
]
