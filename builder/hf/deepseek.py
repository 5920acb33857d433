"""DeepSeek-V2 and V3 (``deepseek_v2``, ``deepseek_v3``): multi-head latent attention
(``mla``) and DeepSeekMoE (``deepseek_moe``), the first ``first_k_dense_replace`` layers dense.

One table reads and writes both; :class:`DeepSeekKnobs` says how V3 differs (sigmoid scores,
groups ranked by their two best biased scores, the expert bias, ``norm_topk_prob``).
Checkpoints keep the rotary dimensions interleaved (pairs ``(x0, x1), (x2, x3)...``: V2's
complex rotation, V3's ``rope_interleave``); our RoPE rotates halves, so the rotary rows of
``q_proj``/``q_b_proj`` and ``kv_a_proj_with_mqa`` are permuted on import and back on export,
which leaves every score unchanged. Routed experts are per-expert tensors on disk (as
``save_pretrained`` and the released checkpoints write them) and stacked here; transformers
5.x's in-memory fused ``gate_up_proj`` layout reads too.

V3's multi-token prediction (``num_nextn_predict_layers`` modules, head ``mtp``) is read and
written: module ``k`` is ``model.layers.{num_hidden_layers + k}``, a decoder layer's tensors plus
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; its ``embed_tokens`` and
``shared_head.head`` are copies of the main model's, which import checks are equal (the model
shares one of each) and export writes again. A checkpoint without those tensors (transformers
saves the main model only) reads as the main model, whatever its config says. The loss weight, a
training setting with no Hugging Face key, travels as ``mtp_loss_weight`` (transformers keeps
unknown keys).
"""

from __future__ import annotations

from dataclasses import dataclass

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import (
    Family,
    HFError,
    Link,
    Unsupported,
    activation_from_hf,
    activation_to_hf,
    dropout,
    need,
    permuted_rows,
    rope_from_hf,
    rope_to_hf,
    same,
    split,
    stacked,
)


@dataclass(frozen=True)
class DeepSeekKnobs:
    v3: bool  # sigmoid scores, top2_sum groups, expert bias, norm_topk_prob, rope_interleave


def _shared(hf: list[str], our: str) -> Link:
    """One tensor of ours that the checkpoint stores several times (the main model's embedding or
    head and each multi-token-prediction module's copy): import checks the copies are equal."""

    def to_ours(ts):
        # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
        import torch

        for name, t in zip(hf[1:], ts[1:]):
            if t.shape != ts[0].shape or not torch.equal(t, ts[0]):
                raise HFError(
                    f"{name} differs from {hf[0]}; this model shares one tensor between the main model "
                    "and its multi-token-prediction modules"
                )
        return [ts[0]]

    return Link(tuple(hf), (our,), to_ours, lambda ts: [ts[0]] + [ts[0].clone() for _ in hf[1:]])


def _mtp_depth(config: dict, names: set[str], n_layers: int, family: str) -> int:
    """The multi-token-prediction modules the folder holds: ``num_nextn_predict_layers``, or 0
    when its tensors are absent (a checkpoint of the main model alone)."""
    depth = config.get("num_nextn_predict_layers") or 0
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise HFError(f"{family}: num_nextn_predict_layers: expected an integer from 0, got {depth!r}")
    if depth and names and not all(f"model.layers.{n_layers + k}.eh_proj.weight" in names for k in range(depth)):
        return 0
    return depth


class DeepSeek(Family):
    def __init__(self, knobs: DeepSeekKnobs, **kwargs):
        super().__init__(**kwargs)
        self.knobs = knobs

    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        v3, family = self.knobs.v3, self.model_type
        d, n_heads = need(config, "hidden_size", family), need(config, "num_attention_heads", family)
        n_layers = need(config, "num_hidden_layers", family)
        if (config.get("num_key_value_heads") or n_heads) != n_heads:
            raise Unsupported(
                f"{family}: num_key_value_heads differs from num_attention_heads; MLA gives every "
                "head its own key and value"
            )
        if v3 and config.get("rope_interleave", True) is not True:
            raise Unsupported(
                f"{family}: rope_interleave false (rotate-half weights) is not read; released "
                "checkpoints are interleaved"
            )
        if config.get("mlp_bias"):
            raise Unsupported(f"{family}: mlp_bias (biases on the dense and shared MLPs only) has no counterpart here")
        if (config.get("moe_layer_freq") or 1) != 1:
            raise Unsupported(f"{family}: moe_layer_freq other than 1 (transformers ignores it) is not read")
        rope = need(config, "qk_rope_head_dim", family)
        attention = {
            "type": "mla",
            "n_heads": n_heads,
            "q_lora_rank": config.get("q_lora_rank"),
            "kv_lora_rank": need(config, "kv_lora_rank", family),
            "qk_nope_head_dim": need(config, "qk_nope_head_dim", family),
            "qk_rope_head_dim": rope,
            "v_head_dim": need(config, "v_head_dim", family),
            "bias": bool(config.get("attention_bias", False)),
            "dropout": dropout(config.get("attention_dropout")),
        }
        act = activation_from_hf(config.get("hidden_act") or "silu", family)
        dense = {"type": "glu", "activation": act, "hidden_dim": need(config, "intermediate_size", family)}
        moe = {
            "type": "deepseek_moe",
            "n_experts": need(config, "n_routed_experts", family),
            "top_k": need(config, "num_experts_per_tok", family),
            "n_shared_experts": config.get("n_shared_experts") or 0,
            "expert": {"type": "glu", "activation": act, "hidden_dim": need(config, "moe_intermediate_size", family)},
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            **(self._v3_routing(config) if v3 else self._v2_routing(config)),
        }
        first_dense = min(config.get("first_k_dense_replace") or 0, n_layers)
        stack = {
            "n_layers": n_layers,
            "attention": attention,
            "ffn": moe if first_dense < n_layers else dense,
            "norm": {"type": "rmsnorm", "eps": config.get("rms_norm_eps", 1e-6), "placement": "pre"},
            "final_norm": True,
        }
        if 0 < first_dense < n_layers:
            stack["overrides"] = [{"layers": f"0:{first_dense}", "ffn": dense}]
        head = {"type": "lm", "bias": False}
        depth = _mtp_depth(config, names, n_layers, family) if v3 else 0
        if depth:  # each module's layer: the stack's own blocks (the MoE layer), as transformers builds it
            weight = config.get("mtp_loss_weight", 0.3)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise HFError(f"{family}: mtp_loss_weight: expected a number, got {type(weight).__name__}")
            head = {"type": "mtp", "num_nextn_predict_layers": depth, "loss_weight": float(weight)}
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", family),
            "d_model": d,
            "max_seq_len": config.get("max_position_embeddings", 4096 if v3 else 2048),
            "tie_embeddings": config.get("tie_word_embeddings", False),
            "embedding": {"scale": "none"},
            "position": rope_from_hf(config, 10000.0, rope, mscale=True),
            "decoder": stack,
            "head": head,
        }

    def _v2_routing(self, config: dict) -> dict:
        method = config.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise Unsupported(
                f"deepseek_v2: topk_method {method!r}; transformers' DeepseekV2 knows greedy and group_limited_greedy"
            )
        if (config.get("scoring_func") or "softmax") != "softmax":
            raise Unsupported("deepseek_v2: scoring_func other than softmax (transformers' DeepseekV2 uses softmax)")
        if config.get("norm_topk_prob"):
            raise Unsupported(
                "deepseek_v2: norm_topk_prob true: transformers' DeepseekV2 does not renormalise "
                "(DeepSeek's own code does); no exact counterpart"
            )
        if method == "greedy":
            return {"scoring": "softmax"}
        return {
            "scoring": "softmax",
            "n_groups": need(config, "n_group", "deepseek_v2"),
            "topk_groups": need(config, "topk_group", "deepseek_v2"),
            "group_score": "max",
        }

    def _v3_routing(self, config: dict) -> dict:
        if (config.get("topk_method") or "noaux_tc") != "noaux_tc":
            raise Unsupported("deepseek_v3: topk_method other than noaux_tc (transformers' DeepseekV3 routes so)")
        if (config.get("scoring_func") or "sigmoid") != "sigmoid":
            raise Unsupported("deepseek_v3: scoring_func other than sigmoid (transformers' DeepseekV3 uses sigmoid)")
        return {
            "scoring": "sigmoid",
            "n_groups": config.get("n_group") or 1,
            "topk_groups": config.get("topk_group") or 1,
            "group_score": "top2_sum",
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "expert_bias": True,
        }

    # spec -> config.json
    def to_config(self, spec) -> dict:
        v3, stack, family = self.knobs.v3, spec.decoder, self.model_type
        attn = stack.attention
        if attn.type != "mla":
            raise Unsupported(f"decoder.attention is {attn.type!r}; {family} uses mla")
        if attn.norm_eps != 1e-6:
            raise Unsupported(f"attention.norm_eps is {attn.norm_eps}; {family}'s latent norms use 1e-6")
        if attn.scale is not None:
            raise Unsupported(f"attention.scale is set; {family} scales scores by 1/sqrt(qk head dim)")
        ffns = [stack.layer(i).ffn for i in range(stack.n_layers)]
        first_dense = next((i for i, f in enumerate(ffns) if f.type == "deepseek_moe"), stack.n_layers)
        dense = ffns[0] if first_dense else None
        moe = ffns[first_dense] if first_dense < stack.n_layers else None
        config = {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.d_model,
            "num_hidden_layers": stack.n_layers,
            "num_attention_heads": attn.n_heads,
            "num_key_value_heads": attn.n_heads,
            "q_lora_rank": attn.q_lora_rank,
            "kv_lora_rank": attn.kv_lora_rank,
            "qk_nope_head_dim": attn.qk_nope_head_dim,
            "qk_rope_head_dim": attn.qk_rope_head_dim,
            "v_head_dim": attn.v_head_dim,
            "attention_bias": attn.bias,
            "attention_dropout": attn.dropout,
            "first_k_dense_replace": first_dense,
            "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": stack.norm.eps,
            "tie_word_embeddings": spec.tie_embeddings,
            **rope_to_hf(spec.position),
        }
        config.update(self._mtp_config(spec, moe))
        expert = moe.expert if moe is not None else dense
        config["hidden_act"] = activation_to_hf(getattr(expert, "activation", "silu"), "gelu_pytorch_tanh")
        config["intermediate_size"] = dense.resolved_hidden_dim(spec.d_model) if dense is not None else 1
        if moe is None:  # every layer dense: the MoE keys are unused
            config.update(n_routed_experts=1, num_experts_per_tok=1, n_shared_experts=0, moe_intermediate_size=1)
            return config
        config.update(
            n_routed_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            n_shared_experts=moe.n_shared_experts,
            moe_intermediate_size=moe.expert.resolved_hidden_dim(spec.d_model),
            routed_scaling_factor=moe.routed_scaling_factor,
            n_group=moe.n_groups,
            topk_group=moe.topk_groups,
            norm_topk_prob=moe.norm_topk_prob,
        )
        if v3:
            config.update(topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True)
        else:
            config.update(topk_method="greedy" if moe.n_groups == 1 else "group_limited_greedy", scoring_func="softmax")
        return config

    def _mtp_config(self, spec, moe) -> dict:
        """``num_nextn_predict_layers`` (0 without an ``mtp`` head) and the loss weight."""
        head = spec.head
        if head.type != "mtp":
            return {"num_nextn_predict_layers": 0} if self.knobs.v3 else {}
        if not self.knobs.v3:
            raise Unsupported(f"head is mtp; {self.model_type} has no multi-token prediction (deepseek_v3 has)")
        if moe is None:
            raise Unsupported("head is mtp over a decoder without a MoE layer; deepseek_v3's modules are MoE layers")
        return {"num_nextn_predict_layers": head.num_nextn_predict_layers, "mtp_loss_weight": head.loss_weight}

    # tensor names
    def links(self, spec) -> list[Link]:
        stack, head = spec.decoder, spec.head
        depth = head.num_nextn_predict_layers if head.type == "mtp" else 0
        mtp = [f"model.layers.{stack.n_layers + k}" for k in range(depth)]
        tied = spec.tie_embeddings
        embedding = ["model.embed_tokens.weight"] + [f"{h}.embed_tokens.weight" for h in mtp]
        embedding += [f"{h}.shared_head.head.weight" for h in mtp] if tied else []  # the head is the embedding
        links = [
            _shared(embedding, ours.token_embedding("decoder")),
            same("model.norm.weight", ours.final_norm("decoder") + ".weight"),
        ]
        for i in range(stack.n_layers):
            links += self._layer_links(f"model.layers.{i}", ours.layer("decoder", i), stack.layer(i))
        for k, h in enumerate(mtp):
            module = ours.head(f"mtp.{k}")
            links += self._layer_links(h, f"{module}.layer", head.layer.layer())
            links += [same(f"{h}.{n}.weight", f"{module}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
            links.append(same(f"{h}.shared_head.norm.weight", f"{module}.norm.weight"))
        if not tied:
            links.append(
                _shared(["lm_head.weight"] + [f"{h}.shared_head.head.weight" for h in mtp], ours.head_projection())
            )
        return links

    def _layer_links(self, h: str, layer: str, config) -> list[Link]:
        """One decoder layer's tensors: ``h`` its Hugging Face prefix, ``layer`` ours (a stack's
        layer, or a multi-token-prediction module's)."""
        ffn = f"{layer}.ffn"
        links = self._attention_links(f"{h}.self_attn", f"{layer}.attention", config.attention)
        links += [
            same(f"{h}.input_layernorm.weight", f"{layer}.attention_norm.weight"),
            same(f"{h}.post_attention_layernorm.weight", f"{layer}.ffn_norm.weight"),
        ]
        moe = config.ffn
        if moe.type != "deepseek_moe":
            return links + [same(f"{h}.mlp.{p}_proj.weight", f"{ffn}.{p}_proj.weight") for p in ("gate", "up", "down")]
        links.append(same(f"{h}.mlp.gate.weight", f"{ffn}.router.weight"))
        if moe.expert_bias:
            links.append(same(f"{h}.mlp.gate.e_score_correction_bias", f"{ffn}.expert_bias"))
        for p in ("gate", "up", "down"):
            per_expert = [f"{h}.mlp.experts.{e}.{p}_proj.weight" for e in range(moe.n_experts)]
            links.append(stacked(per_expert, f"{ffn}.experts.{p}_proj.weight"))
            if moe.n_shared_experts:
                links.append(same(f"{h}.mlp.shared_experts.{p}_proj.weight", f"{ffn}.shared_experts.{p}_proj.weight"))
        return links

    @staticmethod
    def _attention_links(h: str, attn: str, config) -> list[Link]:
        heads, qk, rope = config.n_heads, config.qk_head_dim, config.qk_rope_head_dim
        links = []
        query = f"{h}.q_proj" if config.q_lora_rank is None else f"{h}.q_b_proj"
        links.append(
            permuted_rows(
                f"{query}.weight", f"{attn}.{query.rsplit('.', 1)[1]}.weight", heads, qk, config.qk_nope_head_dim, rope
            )
        )
        if config.q_lora_rank is not None:
            links += [
                same(f"{h}.q_a_proj.weight", f"{attn}.q_a_proj.weight"),
                same(f"{h}.q_a_layernorm.weight", f"{attn}.q_a_layernorm.weight"),
            ]
            if config.bias:
                links.append(same(f"{h}.q_a_proj.bias", f"{attn}.q_a_proj.bias"))
        kv_a = config.kv_lora_rank + rope
        for p in ("weight", "bias") if config.bias else ("weight",):
            links.append(
                permuted_rows(
                    f"{h}.kv_a_proj_with_mqa.{p}", f"{attn}.kv_a_proj_with_mqa.{p}", 1, kv_a, config.kv_lora_rank, rope
                )
            )
        links += [
            same(f"{h}.kv_a_layernorm.weight", f"{attn}.kv_a_layernorm.weight"),
            same(f"{h}.kv_b_proj.weight", f"{attn}.kv_b_proj.weight"),
            same(f"{h}.o_proj.weight", f"{attn}.out_proj.weight"),
        ]
        if config.bias:
            links.append(same(f"{h}.o_proj.bias", f"{attn}.out_proj.bias"))
        return links


def fused_experts(spec) -> list[Link]:
    """transformers 5.x's in-memory layout of the routed experts (3-D ``gate_up_proj``,
    ``down_proj``), as a checkpoint saved from its state dict holds it; read as an alternative."""
    stack, links = spec.decoder, []
    for i in range(stack.n_layers):
        config = stack.layer(i).ffn
        if config.type != "deepseek_moe":
            continue
        ffn, hidden = ours.ffn("decoder", i), config.expert.resolved_hidden_dim(spec.d_model)
        experts = f"model.layers.{i}.mlp.experts"
        links += [
            split(
                f"{experts}.gate_up_proj",
                [f"{ffn}.experts.gate_proj.weight", f"{ffn}.experts.up_proj.weight"],
                [hidden, hidden],
                dim=1,
            ),
            same(f"{experts}.down_proj", f"{ffn}.experts.down_proj.weight"),
        ]
    return links


def _deepseek(model_type: str, hf_class: str, description: str, knobs: DeepSeekKnobs) -> DeepSeek:
    return DeepSeek(
        knobs,
        model_type=model_type,
        hf_class=hf_class,
        auto_class="AutoModelForCausalLM",
        description=description,
        tied=("lm_head.weight", "model.embed_tokens.weight"),
        # recomputed rotary buffers
        ignored=(r"model\.rotary_emb\.inv_freq", r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
        alternative_links=fused_experts,
    )


FAMILIES = [
    _deepseek(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepSeek-V2: multi-head latent attention, DeepSeekMoE (softmax, shared experts), YaRN with mscale",
        DeepSeekKnobs(v3=False),
    ),
    _deepseek(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepSeek-V3: V2 with sigmoid routing over expert groups and the auxiliary-loss-free expert bias",
        DeepSeekKnobs(v3=True),
    ),
]
