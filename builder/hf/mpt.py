"""MPT (``mpt``, transformers' ``MptForCausalLM``): ALiBi, a fused bias-free ``Wqkv``, a GELU MLP
four times ``d_model`` wide, bias-free pre-LayerNorms, a tied head.

The spec states what transformers' MPT computes, which is less than ``MptConfig`` can say:
its modules hard-code several things MosaicML's own code reads from the config. Where the
two would compute different models from one config, or where nothing here has the
counterpart, the config is refused with the key and the reason, never approximated:

- ``attn_config.alibi`` false, ``alibi_bias_max`` other than 8: transformers applies ALiBi
  with 8 whatever they say (MosaicML's code would not). The slopes are then MPT's
  ``2^(-8k/n)`` series over the next power of two, odd members first, which is exactly
  :func:`yamlformer.blocks.positions.alibi_slopes` for every head count (``tests/test_hf_mpt.py`` checks).
- ``no_bias`` false, ``expansion_ratio`` other than 4, ``attn_type`` other than multi-head,
  ``qk_ln``, ``prefix_lm``, ``logit_scale``: transformers ignores them (no biases, a
  ``4 * d_model`` MLP, a ``3 * d_model`` ``Wqkv``, no query/key norm, causal attention,
  unscaled logits), so a checkpoint that uses them is not what it computes.
- ``clip_qkv`` (clamping q, k and v), ``embedding_fraction`` other than 1 (MPT's shrunken
  embedding gradient), a ``norm_type`` that is not a LayerNorm: no counterpart here.

Read as transformers reads them: ``softmax_scale`` is ``attention.scale`` (null: 1/sqrt(head
dim)); ``learned_pos_emb`` is ignored (ALiBi models have no position table, in either code);
``attn_uses_sequence_id`` is a training-data option (``data.packing: doc_masked`` here), not
part of the model. Dropout: ``attn_pdrop`` on the attention weights, ``resid_pdrop`` on the
residual branches, ``emb_pdrop`` after the embedding, as MPT's config documents them. Export
writes ``attn_pdrop: 0``: transformers 5.x's ``MptAttentionConfig`` takes only an integer there,
and export matches everything but dropout.
"""

from __future__ import annotations

from yamlformer.builder.hf import names as ours
from yamlformer.builder.hf.common import Family, Link, Unsupported, decoder_links, dropout, need, same, split

#: the ALiBi slope exponent transformers' MPT always uses (``build_mpt_alibi_tensor``'s default)
ALIBI_BIAS_MAX = 8
#: transformers' ``MptMLP`` is ``4 * d_model`` wide whatever ``expansion_ratio`` says
EXPANSION_RATIO = 4
#: MPT's LayerNorm spellings: the low-precision one is a LayerNorm run in the autocast dtype
LAYER_NORMS = ("low_precision_layernorm", "layernorm")


class MPT(Family):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        d, n_heads = need(config, "d_model", "mpt"), need(config, "n_heads", "mpt")
        attn = config.get("attn_config") or {}
        _refuse_what_transformers_ignores(config, attn)
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", "mpt"),
            "d_model": d,
            "max_seq_len": config.get("max_seq_len", 2048),
            "tie_embeddings": config.get("tie_word_embeddings", True),
            "embedding": {"dropout": dropout(config.get("emb_pdrop"))},
            "position": {"type": "alibi"},
            "decoder": {
                "n_layers": need(config, "n_layers", "mpt"),
                "attention": {
                    "n_heads": n_heads,
                    "scale": attn.get("softmax_scale"),
                    "dropout": dropout(attn.get("attn_pdrop")),
                },
                "ffn": {"type": "mlp", "activation": "gelu", "hidden_dim": EXPANSION_RATIO * d, "bias": False},
                "norm": {
                    "type": "layernorm",
                    "eps": config.get("layer_norm_epsilon", 1e-5),
                    "bias": False,
                    "placement": "pre",
                },
                "final_norm": True,
                "dropout": dropout(config.get("resid_pdrop")),
            },
            "head": {"type": "lm", "bias": False},
        }

    # spec -> config.json
    def to_config(self, spec) -> dict:
        stack = spec.decoder
        attn = stack.attention
        if spec.position.type != "alibi":
            raise Unsupported(f"position.type is {spec.position.type!r}; mpt uses alibi")
        # What transformers' MPT hard-codes is written as it is (no biases, a 4 * d_model MLP,
        # multi-head, LayerNorm); a spec that differs fails export's round-trip comparison, which
        # names the field.
        return {
            "vocab_size": spec.vocab_size,
            "d_model": spec.d_model,
            "n_heads": attn.n_heads,
            "n_layers": stack.n_layers,
            "expansion_ratio": EXPANSION_RATIO,
            "max_seq_len": spec.max_seq_len,
            "layer_norm_epsilon": stack.norm.eps,
            "no_bias": True,
            "norm_type": LAYER_NORMS[0],
            "learned_pos_emb": False,
            "logit_scale": None,
            "embedding_fraction": 1.0,
            "emb_pdrop": spec.embedding.dropout,
            "resid_pdrop": stack.dropout,
            "tie_word_embeddings": spec.tie_embeddings,
            "attn_config": {
                "attn_type": "multihead_attention",
                # transformers 5.x's strict MptAttentionConfig takes attn_pdrop as an integer only
                # (and its MPT applies it to the residuals too): the rate is not written, as
                # export matches everything but dropout
                "attn_pdrop": 0,
                "attn_impl": "torch",
                "clip_qkv": None,
                "softmax_scale": attn.scale,
                "prefix_lm": False,
                "qk_ln": False,
                "attn_uses_sequence_id": False,
                "alibi": True,
                "alibi_bias_max": ALIBI_BIAS_MAX,
            },
        }

    # tensor names
    def links(self, spec) -> list[Link]:
        d = spec.d_model

        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            return [
                same(f"{h}.norm_1.weight", ours.layer_norm("decoder", i, "attention") + ".weight"),
                # rows: q, then k, then v (MptAttention chunks the output in three)
                split(f"{h}.attn.Wqkv.weight", [f"{attn}.{p}_proj.weight" for p in "qkv"], [d, d, d]),
                same(f"{h}.attn.out_proj.weight", f"{attn}.out_proj.weight"),
                same(f"{h}.norm_2.weight", ours.layer_norm("decoder", i, "ffn") + ".weight"),
                same(f"{h}.ffn.up_proj.weight", f"{ffn}.up_proj.weight"),
                same(f"{h}.ffn.down_proj.weight", f"{ffn}.down_proj.weight"),
            ]

        return decoder_links(
            spec,
            layer_links,
            embedding="transformer.wte.weight",
            final_norm=("transformer.norm_f.weight",),
            layers="transformer.blocks",
        )


def _refuse_what_transformers_ignores(config: dict, attn: dict) -> None:
    """One :class:`Unsupported` for the first config value transformers' MPT does not compute
    as MPT means it, or that nothing here expresses (see the module docstring)."""
    ignores = "transformers' MptForCausalLM ignores it"
    if attn.get("alibi", True) is not True:
        raise Unsupported(f"mpt: attn_config.alibi false (learned positions): {ignores} and applies ALiBi")
    if attn.get("alibi_bias_max", ALIBI_BIAS_MAX) != ALIBI_BIAS_MAX:
        raise Unsupported(
            f"mpt: attn_config.alibi_bias_max {attn['alibi_bias_max']}: {ignores} and computes its "
            f"ALiBi slopes with {ALIBI_BIAS_MAX}, as the slopes here are; no exact counterpart"
        )
    if (attn.get("attn_type") or "multihead_attention") != "multihead_attention":
        raise Unsupported(
            f"mpt: attn_config.attn_type is not multihead_attention: {ignores} (its Wqkv is 3 * d_model wide)"
        )
    if attn.get("clip_qkv"):
        raise Unsupported(f"mpt: attn_config.clip_qkv {attn['clip_qkv']}: clamping q, k and v has no counterpart here")
    if attn.get("qk_ln"):
        raise Unsupported(f"mpt: attn_config.qk_ln true: {ignores} (it has no query/key LayerNorm)")
    if attn.get("prefix_lm"):
        raise Unsupported(f"mpt: attn_config.prefix_lm true (a bidirectional prefix): {ignores}")
    if config.get("no_bias", True) is not True:
        raise Unsupported(f"mpt: no_bias false: {ignores} (it has no biases and would drop the checkpoint's)")
    if config.get("expansion_ratio", EXPANSION_RATIO) != EXPANSION_RATIO:
        raise Unsupported(
            f"mpt: expansion_ratio {config['expansion_ratio']}: {ignores} (its MLP is {EXPANSION_RATIO} * d_model wide)"
        )
    if config.get("logit_scale") is not None:
        raise Unsupported(f"mpt: logit_scale is set: {ignores} (MosaicML's code scales the logits)")
    if config.get("embedding_fraction", 1.0) != 1.0:
        raise Unsupported(
            f"mpt: embedding_fraction {config['embedding_fraction']} (a shrunken embedding "
            "gradient) has no counterpart here"
        )
    if config.get("norm_type", LAYER_NORMS[0]) not in LAYER_NORMS:
        raise Unsupported(
            f"mpt: norm_type is not a LayerNorm ({', '.join(LAYER_NORMS)}): {ignores} and normalises with LayerNorm"
        )


FAMILIES = [
    MPT(
        model_type="mpt",
        hf_class="MptForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="MPT: ALiBi, fused bias-free Wqkv, GELU MLP, bias-free pre-LayerNorm, tied head",
        tied=("lm_head.weight", "transformer.wte.weight"),
    ),
]
