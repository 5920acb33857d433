"""Hugging Face families with an encoder: BERT (masked LM), T5 (v1.0 and v1.1), Marian (the
2017 Transformer layout: post-norm, sinusoidal positions, biases everywhere) and Pegasus (the same
layout pre-norm, with a final norm on each stack: the zoo's transformer-multi30k)."""

from __future__ import annotations

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
    same,
)

_WB = ("weight", "bias")


def _pairs(hf: str, our: str, parts=_WB) -> list[Link]:
    return [same(f"{hf}.{p}", f"{our}.{p}") for p in parts]


# --- BERT --------------------------------------------------------------------------------

#: BERT's sequence classifier: the pooler (dense + tanh over [CLS]) and a linear classifier
_CLASSIFIER = ("BertForSequenceClassification", "AutoModelForSequenceClassification")


def _classifies(config: dict, names: set[str]) -> bool:
    return _CLASSIFIER[0] in (config.get("architectures") or []) or "classifier.weight" in names


def _n_labels(config: dict) -> int:
    labels = config.get("id2label")
    if labels is not None and not isinstance(labels, dict):
        raise HFError("bert: id2label is not a mapping of class ids to names")
    n = len(labels) if labels else config.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise HFError("bert: num_labels is not a positive integer")
    return n


class Bert(Family):
    """BERT with its masked-LM head (BertForMaskedLM) or its sequence classifier
    (BertForSequenceClassification: ``head: {type: classification, pooler: true}``)."""

    def classes(self, spec) -> tuple[str, str]:
        return _CLASSIFIER if spec.head.type == "classification" else super().classes(spec)

    def to_spec(self, config: dict, names: set[str]) -> dict:
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise Unsupported(f"bert: position_embedding_type {kind!r}; only 'absolute' has a counterpart here")
        d = need(config, "hidden_size", "bert")
        eps = config.get("layer_norm_eps", 1e-12)
        act = activation_from_hf(config.get("hidden_act", "gelu"), "bert")
        hidden_dropout = dropout(config.get("hidden_dropout_prob"))
        positions = config.get("max_position_embeddings", 512)
        return {
            "architecture": "encoder-only",
            "vocab_size": need(config, "vocab_size", "bert"),
            "d_model": d,
            "max_seq_len": positions,
            "tie_embeddings": config.get("tie_word_embeddings", True),
            "embedding": {
                "norm": {"type": "layernorm", "eps": eps},
                "segments": config.get("type_vocab_size", 2),
                "dropout": hidden_dropout,
            },
            "position": {"type": "learned", "max_positions": positions},
            "encoder": {
                "n_layers": need(config, "num_hidden_layers", "bert"),
                "attention": {
                    "n_heads": need(config, "num_attention_heads", "bert"),
                    "qkv_bias": True,
                    "out_bias": True,
                    "dropout": dropout(config.get("attention_probs_dropout_prob")),
                },
                "ffn": {
                    "type": "mlp",
                    "activation": act,
                    "hidden_dim": config.get("intermediate_size", 4 * d),
                    "bias": True,
                },
                "norm": {"type": "layernorm", "eps": eps, "placement": "post"},
                "final_norm": False,
                "dropout": hidden_dropout,
            },
            "head": self._head(config, names, act, eps, hidden_dropout),
        }

    @staticmethod
    def _head(config: dict, names: set[str], act: str, eps: float, hidden_dropout: float) -> dict:
        if not _classifies(config, names):
            return {"type": "mlm", "activation": act, "norm": {"type": "layernorm", "eps": eps}}
        rate = config.get("classifier_dropout")
        return {
            "type": "classification",
            "n_classes": _n_labels(config),
            "pooling": "first",
            "pooler": True,
            "dropout": hidden_dropout if rate is None else dropout(rate),
        }

    def to_config(self, spec) -> dict:
        stack = spec.encoder
        return {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.d_model,
            "num_hidden_layers": stack.n_layers,
            "num_attention_heads": stack.attention.n_heads,
            "intermediate_size": stack.ffn.resolved_hidden_dim(spec.d_model),
            "hidden_act": getattr(stack.ffn, "activation", "gelu"),
            "max_position_embeddings": getattr(spec.position, "max_positions", None) or spec.max_seq_len,
            "type_vocab_size": spec.embedding.segments,
            "layer_norm_eps": stack.norm.eps,
            "position_embedding_type": "absolute",
            "tie_word_embeddings": spec.tie_embeddings,
            "hidden_dropout_prob": stack.dropout,
            "attention_probs_dropout_prob": stack.attention.dropout,
            **self._head_config(spec.head),
        }

    @staticmethod
    def _head_config(head) -> dict:
        if head.type != "classification":
            return {}
        return {
            "architectures": [_CLASSIFIER[0]],
            "id2label": {str(i): f"LABEL_{i}" for i in range(head.n_classes)},
            "label2id": {f"LABEL_{i}": i for i in range(head.n_classes)},
            "classifier_dropout": head.dropout,
        }

    def links(self, spec) -> list[Link]:
        e = "bert.embeddings"
        links = [
            same(f"{e}.word_embeddings.weight", ours.token_embedding("encoder")),
            same(f"{e}.position_embeddings.weight", ours.learned_positions("encoder")),
            same(f"{e}.token_type_embeddings.weight", ours.segment_embedding("encoder")),
            *_pairs(f"{e}.LayerNorm", ours.embedding_norm("encoder")),
        ]
        classifier = spec.head.type == "classification"
        if classifier:
            links += _pairs("bert.pooler.dense", ours.head("pooler")) + _pairs("classifier", ours.head("classifier"))
        else:
            links += [
                *_pairs("cls.predictions.transform.dense", ours.head("dense")),
                *_pairs("cls.predictions.transform.LayerNorm", ours.head("norm")),
                same("cls.predictions.bias", ours.head_bias()),
            ]
        for i in range(spec.encoder.n_layers):
            h, attn, ffn = f"bert.encoder.layer.{i}", ours.attention("encoder", i), ours.ffn("encoder", i)
            for hf_name, p in (("query", "q"), ("key", "k"), ("value", "v")):
                links += _pairs(f"{h}.attention.self.{hf_name}", f"{attn}.{p}_proj")
            links += _pairs(f"{h}.attention.output.dense", f"{attn}.out_proj")
            links += _pairs(f"{h}.attention.output.LayerNorm", ours.layer_norm("encoder", i, "attention"))
            links += _pairs(f"{h}.intermediate.dense", f"{ffn}.up_proj")
            links += _pairs(f"{h}.output.dense", f"{ffn}.down_proj")
            links += _pairs(f"{h}.output.LayerNorm", ours.layer_norm("encoder", i, "ffn"))
        if not spec.tie_embeddings and not classifier:
            links.append(same("cls.predictions.decoder.weight", ours.head_projection()))
        return links


# --- T5 ----------------------------------------------------------------------------------


class T5(Family):
    def to_spec(self, config: dict, names: set[str]) -> dict:
        d = need(config, "d_model", "t5")
        proj = config.get("feed_forward_proj", "relu")
        gated, _, act_name = proj.rpartition("-")
        if gated not in ("", "gated"):
            raise HFError(f"t5: feed_forward_proj {proj!r} is neither 'ACT' nor 'gated-ACT'")
        if proj == "gated-gelu":
            act_name = "gelu_new"  # as transformers reads it
        ffn = {
            "type": "glu" if gated else "mlp",
            "activation": activation_from_hf(act_name, "t5"),
            "hidden_dim": need(config, "d_ff", "t5"),
            "bias": False,
        }
        rate = dropout(config.get("dropout_rate"))
        attention = {
            "n_heads": need(config, "num_heads", "t5"),
            "head_dim": need(config, "d_kv", "t5"),
            "scale": 1.0,  # T5 folds the 1/sqrt(head_dim) into its initialisation
            "dropout": rate,
        }
        n_layers = need(config, "num_layers", "t5")

        def stack(layers: int) -> dict:
            return {
                "n_layers": layers,
                "attention": dict(attention),
                "ffn": dict(ffn),
                "norm": {"type": "rmsnorm", "eps": config.get("layer_norm_epsilon", 1e-6), "placement": "pre"},
                "final_norm": True,
                "dropout": rate,
            }

        tied = config.get("tie_word_embeddings", True)
        # transformers 5.x keeps `tie_word_embeddings: true` and says `scale_decoder_outputs`;
        # 4.x scales exactly when the head is tied
        scaled = config.get("scale_decoder_outputs", tied)
        return {
            "architecture": "encoder-decoder",
            "vocab_size": need(config, "vocab_size", "t5"),
            "d_model": d,
            "max_seq_len": config.get("n_positions", 512),
            "tie_embeddings": tied,
            "share_encoder_decoder_embeddings": True,
            "embedding": {"dropout": rate},
            "position": {
                "type": "relative_bias",
                "num_buckets": config.get("relative_attention_num_buckets", 32),
                "max_distance": config.get("relative_attention_max_distance", 128),
            },
            "encoder": stack(n_layers),
            "decoder": stack(config.get("num_decoder_layers") or n_layers),
            "head": {"type": "lm", "bias": False, "output_scale": d**-0.5 if scaled else None},
        }

    def to_config(self, spec) -> dict:
        enc, dec = spec.encoder, spec.decoder
        ffn = enc.ffn
        act = activation_to_hf(getattr(ffn, "activation", "relu"), "gelu_new")
        proj = f"gated-{act}" if ffn.type == "glu" else act
        if proj == "gated-gelu_new":
            proj = "gated-gelu"
        position = spec.position
        if position.type != "relative_bias":
            raise Unsupported(f"position.type is {position.type!r}; T5 uses relative_bias")
        return {
            "vocab_size": spec.vocab_size,
            "d_model": spec.d_model,
            "d_kv": enc.attention.resolved_head_dim(spec.d_model),
            "d_ff": ffn.resolved_hidden_dim(spec.d_model) if ffn.type != "moe" else None,
            "num_layers": enc.n_layers,
            "num_decoder_layers": dec.n_layers,
            "num_heads": enc.attention.n_heads,
            "relative_attention_num_buckets": position.num_buckets,
            "relative_attention_max_distance": position.max_distance,
            "layer_norm_epsilon": enc.norm.eps,
            "feed_forward_proj": proj,
            "tie_word_embeddings": spec.tie_embeddings,
            "scale_decoder_outputs": spec.head.type == "lm" and spec.head.output_scale is not None,
            "n_positions": spec.max_seq_len,
            "dropout_rate": enc.dropout,
            "is_encoder_decoder": True,
        }

    def links(self, spec) -> list[Link]:
        links = [same("shared.weight", ours.token_embedding("encoder"))]
        for stack_name in ("encoder", "decoder"):
            stack = getattr(spec, stack_name)
            links += [
                same(
                    f"{stack_name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                    ours.relative_bias(stack_name),
                ),
                same(f"{stack_name}.final_layer_norm.weight", ours.final_norm(stack_name) + ".weight"),
            ]
            for i in range(stack.n_layers):
                block = f"{stack_name}.block.{i}.layer"
                subs = [("SelfAttention", "attention")]
                if stack_name == "decoder":
                    subs.append(("EncDecAttention", "cross_attention"))
                for j, (hf_attn, which) in enumerate(subs):
                    attn = ours.attention(stack_name, i, which)
                    links += [same(f"{block}.{j}.{hf_attn}.{p}.weight", f"{attn}.{p}_proj.weight") for p in "qkv"]
                    links.append(same(f"{block}.{j}.{hf_attn}.o.weight", f"{attn}.out_proj.weight"))
                    links.append(
                        same(f"{block}.{j}.layer_norm.weight", ours.layer_norm(stack_name, i, which) + ".weight")
                    )
                j, ffn = len(subs), ours.ffn(stack_name, i)
                if stack.layer(i).ffn.type == "glu":
                    links.append(same(f"{block}.{j}.DenseReluDense.wi_0.weight", f"{ffn}.gate_proj.weight"))
                    links.append(same(f"{block}.{j}.DenseReluDense.wi_1.weight", f"{ffn}.up_proj.weight"))
                else:
                    links.append(same(f"{block}.{j}.DenseReluDense.wi.weight", f"{ffn}.up_proj.weight"))
                links.append(same(f"{block}.{j}.DenseReluDense.wo.weight", f"{ffn}.down_proj.weight"))
                links.append(same(f"{block}.{j}.layer_norm.weight", ours.layer_norm(stack_name, i, "ffn") + ".weight"))
        if not spec.tie_embeddings:
            links.append(same("lm_head.weight", ours.head_projection()))
        return links


# --- Marian and Pegasus ------------------------------------------------------------------


class Marian(Family):
    """BART's tensor layout with sinusoidal positions. ``pre_norm``: Pegasus's sub-layers normalise
    their input and each stack ends in a norm; Marian's normalise after the residual sum."""

    pre_norm = False
    default_activation = "swish"

    def to_spec(self, config: dict, names: set[str]) -> dict:
        name = self.model_type
        d = need(config, "d_model", name)
        vocab = need(config, "vocab_size", name)
        if config.get("decoder_vocab_size", vocab) != vocab:
            raise Unsupported(
                f"{name}: decoder_vocab_size {config['decoder_vocab_size']} differs from vocab_size "
                f"{vocab}; a spec has one vocabulary"
            )
        act = activation_from_hf(config.get("activation_function", self.default_activation), name)
        rate = dropout(config.get("dropout"))
        if config.get("activation_dropout"):
            raise Unsupported(f"{name}: activation_dropout > 0 (dropout inside the FFN) has no counterpart here")

        def stack(side: str) -> dict:
            return {
                "n_layers": need(config, f"{side}_layers", name),
                "attention": {
                    "n_heads": need(config, f"{side}_attention_heads", name),
                    "qkv_bias": True,
                    "out_bias": True,
                    "dropout": dropout(config.get("attention_dropout")),
                },
                "ffn": {
                    "type": "mlp",
                    "activation": act,
                    "hidden_dim": need(config, f"{side}_ffn_dim", name),
                    "bias": True,
                },
                "norm": {"type": "layernorm", "eps": 1e-5, "placement": "pre" if self.pre_norm else "post"},
                "final_norm": self.pre_norm,
                "dropout": rate,
            }

        return {
            "architecture": "encoder-decoder",
            "vocab_size": vocab,
            "d_model": d,
            "max_seq_len": config.get("max_position_embeddings", 512),
            "tie_embeddings": config.get("tie_word_embeddings", True),
            "share_encoder_decoder_embeddings": config.get("share_encoder_decoder_embeddings", True),
            "embedding": {"scale": "sqrt_d" if config.get("scale_embedding") else "none", "dropout": rate},
            "position": {"type": "sinusoidal", "layout": "split"},
            "encoder": stack("encoder"),
            "decoder": stack("decoder"),
            "head": {"type": "lm", "bias": True},  # final_logits_bias, a buffer there
        }

    def to_config(self, spec) -> dict:
        enc, dec = spec.encoder, spec.decoder
        return {
            "vocab_size": spec.vocab_size,
            "decoder_vocab_size": spec.vocab_size,
            "d_model": spec.d_model,
            "encoder_layers": enc.n_layers,
            "decoder_layers": dec.n_layers,
            "encoder_attention_heads": enc.attention.n_heads,
            "decoder_attention_heads": dec.attention.n_heads,
            "encoder_ffn_dim": enc.ffn.resolved_hidden_dim(spec.d_model) if enc.ffn.type != "moe" else None,
            "decoder_ffn_dim": dec.ffn.resolved_hidden_dim(spec.d_model) if dec.ffn.type != "moe" else None,
            "activation_function": activation_to_hf(getattr(enc.ffn, "activation", "silu"), "gelu_new"),
            "max_position_embeddings": spec.max_seq_len,
            "scale_embedding": spec.embedding.scale == "sqrt_d",
            "share_encoder_decoder_embeddings": spec.share_encoder_decoder_embeddings,
            "tie_word_embeddings": spec.tie_embeddings,
            "dropout": enc.dropout,
            "attention_dropout": enc.attention.dropout,
            "activation_dropout": 0.0,
            "is_encoder_decoder": True,
        }

    def computed(self, spec) -> dict:
        table = _sinusoids(spec.max_seq_len, spec.d_model)
        return {f"model.{side}.embed_positions.weight": table.clone() for side in ("encoder", "decoder")}

    def links(self, spec) -> list[Link]:
        shared = spec.share_encoder_decoder_embeddings
        links: list[Link] = []
        if shared:
            links.append(same("model.shared.weight", ours.token_embedding("encoder")))
        else:
            links.append(same("model.encoder.embed_tokens.weight", ours.token_embedding("encoder")))
            links.append(same("model.decoder.embed_tokens.weight", ours.token_embedding("decoder")))
        bias = Link(
            ("final_logits_bias",),
            (ours.head_bias(),),
            lambda ts: [ts[0].reshape(-1).contiguous()],  # (1, vocab) -> (vocab,)
            lambda ts: [ts[0].reshape(1, -1).contiguous()],
        )
        links.append(bias)
        for side in ("encoder", "decoder"):
            stack = getattr(spec, side)
            if self.pre_norm:
                links += _pairs(f"model.{side}.layer_norm", ours.final_norm(side))
            for i in range(stack.n_layers):
                h = f"model.{side}.layers.{i}"
                subs = [("self_attn", "attention")] + (
                    [("encoder_attn", "cross_attention")] if side == "decoder" else []
                )
                for hf_attn, which in subs:
                    attn = ours.attention(side, i, which)
                    for p in ("q", "k", "v", "out"):
                        links += _pairs(f"{h}.{hf_attn}.{p}_proj", f"{attn}.{p}_proj")
                    links += _pairs(f"{h}.{hf_attn}_layer_norm", ours.layer_norm(side, i, which))
                ffn = ours.ffn(side, i)
                links += _pairs(f"{h}.fc1", f"{ffn}.up_proj") + _pairs(f"{h}.fc2", f"{ffn}.down_proj")
                links += _pairs(f"{h}.final_layer_norm", ours.layer_norm(side, i, "ffn"))
        if not spec.tie_embeddings:
            links.append(same("lm_head.weight", ours.head_projection()))
        return links


def _sinusoids(positions: int, dim: int):
    """The sinusoid table Marian's and Pegasus's classes build (in float64, then float32): sines
    of ``pos / 10000^(2i/dim)`` first, their cosines after."""
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    angles = pos / 10000 ** (2 * (torch.arange(dim) // 2) / dim).to(torch.float64)  # (positions, dim)
    return torch.cat((angles[:, 0::2].sin(), angles[:, 1::2].cos()), dim=1).float()


class Pegasus(Marian):
    """Pegasus: Marian's layout pre-norm, one embedding table for both stacks, GELU by default."""

    pre_norm = True
    default_activation = "gelu"

    def to_spec(self, config: dict, names: set[str]) -> dict:
        return {**super().to_spec(config, names), "share_encoder_decoder_embeddings": True}

    def to_config(self, spec) -> dict:
        config = super().to_config(spec)
        del config["decoder_vocab_size"], config["share_encoder_decoder_embeddings"]  # not Pegasus keys
        # what google/pegasus-* configs say and CTranslate2's loader reads (transformers does not)
        return {**config, "normalize_before": True, "normalize_embedding": False}


FAMILIES = [
    Bert(
        model_type="bert",
        hf_class="BertForMaskedLM",
        auto_class="AutoModelForMaskedLM",
        description="BERT: post-LayerNorm encoder, token types, learned positions, masked-LM head",
        tied=("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
        ignored=(
            r"bert\.embeddings\.(position_ids|token_type_ids)",  # index buffers
            r"cls\.predictions\.decoder\.bias",  # the same tensor as cls.predictions.bias
            r"bert\.pooler\..*",  # BertForPreTraining's next-sentence parts; BertForMaskedLM drops them too
            r"cls\.seq_relationship\..*",
        ),
    ),
    T5(
        model_type="t5",
        hf_class="T5ForConditionalGeneration",
        auto_class="AutoModelForSeq2SeqLM",
        description="T5 v1.0 (ReLU, tied, scaled head) and v1.1 (gated GELU, untied): relative bias, RMSNorm",
        tied=("lm_head.weight", "shared.weight"),
        ignored=(r"(encoder|decoder)\.embed_tokens\.weight",),  # copies of `shared`
    ),
    Marian(
        model_type="marian",
        hf_class="MarianMTModel",
        auto_class="AutoModelForSeq2SeqLM",
        description="Marian / the 2017 Transformer: post-LayerNorm, split sinusoidal positions, logits bias",
        tied=("lm_head.weight", "model.decoder.embed_tokens.weight", "model.shared.weight"),
        ignored=(r"model\.(encoder|decoder)\.embed_positions\.weight",),  # recomputed sinusoids
        needs=("pad_token_id", "decoder_start_token_id"),  # the class defaults are 58100 and 58100
    ),
    Pegasus(
        model_type="pegasus",
        hf_class="PegasusForConditionalGeneration",
        auto_class="AutoModelForSeq2SeqLM",
        description="Pegasus: Marian's layout with pre-LayerNorm and a final norm per stack",
        tied=(
            "lm_head.weight",
            "model.shared.weight",
            "model.decoder.embed_tokens.weight",
            "model.encoder.embed_tokens.weight",
        ),
        ignored=(
            r"model\.(encoder|decoder)\.embed_positions\.weight",  # recomputed sinusoids
            r"model\.(encoder|decoder)\.embed_tokens\.weight",  # copies of model.shared
        ),
        start_from_pad=True,
    ),
]
