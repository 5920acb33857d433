"""GPT-NeoX (``gpt_neox``, transformers' ``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B): the
parallel residual, partial rotary embeddings, a per-head fused ``query_key_value``.

Each layer computes ``x + attn(ln1(x)) + mlp(ln2(x))`` (``use_parallel_residual``, the
default: ``decoder.parallel_residual: true`` here, norms ``attention_norm`` and ``ffn_norm``)
or, with it false, the sequential pre-norm layer. Only the first ``rotary_pct`` of each head's
dimensions rotate (``position.rotary_fraction``; transformers' default is 0.25, not 1).
``query_key_value`` holds, for each head in turn, its query, key and value rows
(``GPTNeoXAttention`` views the output as ``(heads, 3 * head_dim)`` and chunks it), so import
regroups the rows into our separate projections and export interleaves them back.

Read as transformers reads them: ``attention_bias`` puts biases on ``query_key_value`` and
``dense`` (the MLP always has them); ``hidden_dropout`` is the dropout after the embedding and
on both residual branches, ``attention_dropout`` on the attention weights. The RoPE base and
fraction come from ``rope_parameters`` (5.x) or ``rotary_emb_base`` and ``rotary_pct`` (4.x and
published checkpoints); export writes both spellings. Export writes null token ids:
``GPTNeoXConfig`` defaults them to 0 and 2, which would stop a client's generation at token 2.
"""

from __future__ import annotations

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
)

#: GPTNeoXConfig's RoPE defaults when a config names neither spelling
DEFAULT_THETA, DEFAULT_ROTARY_PCT = 10000.0, 0.25


def _per_head_qkv(hf: str, names: list[str], heads: int) -> Link:
    """``hf`` (a weight ``(heads * 3 * head_dim, d)`` or a bias) holds each head's q, k and v
    rows in turn; ``names`` are our q, k and v projections' tensors."""

    def to_ours(ts):
        t = ts[0]
        grouped = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])  # (heads, 3, head_dim, ...)
        return [grouped[:, j].reshape(-1, *t.shape[1:]).contiguous() for j in range(3)]

    def to_hf(ts):
        # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
        import torch

        parts = [t.reshape(heads, t.shape[0] // heads, *t.shape[1:]) for t in ts]  # each (heads, head_dim, ...)
        return [torch.stack(parts, dim=1).reshape(-1, *ts[0].shape[1:]).contiguous()]

    return Link((hf,), tuple(names), to_ours, to_hf)


class GPTNeoX(Family):
    # config.json -> spec
    def to_spec(self, config: dict, names: set[str]) -> dict:
        family = self.model_type
        d, n_heads = need(config, "hidden_size", family), need(config, "num_attention_heads", family)
        if d % n_heads:
            raise Unsupported(f"{family}: hidden_size {d} is not a multiple of num_attention_heads {n_heads}")
        head_dim = d // n_heads
        rope = {
            **config,
            "rope_theta": config.get("rotary_emb_base", DEFAULT_THETA),
            "partial_rotary_factor": config.get("rotary_pct", DEFAULT_ROTARY_PCT),
        }
        bias = bool(config.get("attention_bias", True))
        hidden_dropout = dropout(config.get("hidden_dropout"))
        stack = {
            "n_layers": need(config, "num_hidden_layers", family),
            "attention": {
                "n_heads": n_heads,
                "qkv_bias": bias,
                "out_bias": bias,
                "dropout": dropout(config.get("attention_dropout")),
            },
            "ffn": {
                "type": "mlp",
                "activation": activation_from_hf(config.get("hidden_act") or "gelu", family),
                "hidden_dim": need(config, "intermediate_size", family),
                "bias": True,
            },
            "norm": {"type": "layernorm", "eps": config.get("layer_norm_eps", 1e-5), "placement": "pre"},
            "final_norm": True,
            "dropout": hidden_dropout,
        }
        if config.get("use_parallel_residual", True):
            stack["parallel_residual"] = True
        position = rope_from_hf(rope, DEFAULT_THETA, head_dim)
        return {
            "architecture": "decoder-only",
            "vocab_size": need(config, "vocab_size", family),
            "d_model": d,
            "max_seq_len": config.get("max_position_embeddings", 2048),
            "tie_embeddings": config.get("tie_word_embeddings", False),
            "embedding": {"dropout": hidden_dropout},
            "position": position,
            "decoder": stack,
            "head": {"type": "lm", "bias": False},
        }

    # spec -> config.json
    def to_config(self, spec) -> dict:
        stack = spec.decoder
        attn, ffn = stack.attention, stack.ffn
        if stack.parallel_residual not in (True, False):
            raise Unsupported(
                f"decoder.parallel_residual is {stack.parallel_residual!r}; gpt_neox's parallel layer has two norms"
            )
        rope = rope_to_hf(spec.position)
        theta, fraction = rope.pop("rope_theta"), spec.position.rotary_fraction
        scaling = rope.pop("rope_scaling") or {"rope_type": "default"}
        return {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.d_model,
            "num_hidden_layers": stack.n_layers,
            "num_attention_heads": attn.n_heads,
            "intermediate_size": ffn.resolved_hidden_dim(spec.d_model),
            "hidden_act": activation_to_hf(getattr(ffn, "activation", "gelu"), "gelu_new"),
            "layer_norm_eps": stack.norm.eps,
            "attention_bias": attn.qkv_bias,
            "use_parallel_residual": stack.parallel_residual is True,
            "max_position_embeddings": spec.max_seq_len,
            "tie_word_embeddings": spec.tie_embeddings,
            "attention_dropout": attn.dropout,
            "hidden_dropout": stack.dropout,
            # 5.x reads rope_parameters; 4.x (and 5.x without them) rotary_emb_base and rotary_pct
            "rope_parameters": {**scaling, "rope_theta": theta, "partial_rotary_factor": fraction},
            "rotary_emb_base": theta,
            "rotary_pct": fraction,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }

    # tensor names
    def links(self, spec) -> list[Link]:
        def layer_links(h: str, i: int, layer) -> list[Link]:
            attn, ffn = ours.attention("decoder", i), ours.ffn("decoder", i)
            qkv = [f"{attn}.{p}_proj" for p in "qkv"]
            params = ("weight", "bias") if layer.attention.qkv_bias else ("weight",)
            links = [
                _per_head_qkv(f"{h}.attention.query_key_value.{p}", [f"{q}.{p}" for q in qkv], layer.attention.n_heads)
                for p in params
            ]
            links += [same(f"{h}.attention.dense.{p}", f"{attn}.out_proj.{p}") for p in params]
            for hf_mlp, our_mlp in (("dense_h_to_4h", "up_proj"), ("dense_4h_to_h", "down_proj")):
                links += [same(f"{h}.mlp.{hf_mlp}.{p}", f"{ffn}.{our_mlp}.{p}") for p in ("weight", "bias")]
            for hf_norm, which in (("input_layernorm", "attention"), ("post_attention_layernorm", "ffn")):
                norm = ours.layer_norm("decoder", i, which)
                links += [same(f"{h}.{hf_norm}.{p}", f"{norm}.{p}") for p in ("weight", "bias")]
            return links

        norm = [f"gpt_neox.final_layer_norm.{p}" for p in ("weight", "bias")]
        return decoder_links(
            spec,
            layer_links,
            embedding="gpt_neox.embed_in.weight",
            final_norm=norm,
            layers="gpt_neox.layers",
            head="embed_out.weight",
        )


FAMILIES = [
    GPTNeoX(
        model_type="gpt_neox",
        hf_class="GPTNeoXForCausalLM",
        auto_class="AutoModelForCausalLM",
        description="GPT-NeoX (Pythia): parallel residual, partial RoPE, per-head fused query_key_value, LayerNorm",
        tied=("embed_out.weight", "gpt_neox.embed_in.weight"),
        # buffers older checkpoints carry and transformers recomputes: the causal mask, its fill
        # value and the rotary frequencies
        ignored=(
            r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",
            r"gpt_neox\.rotary_emb\.inv_freq",
        ),
    ),
]
