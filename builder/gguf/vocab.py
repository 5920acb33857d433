"""A tokenizer state (:mod:`yamlformer.builder.hf.tokenizer`) written as GGUF metadata, such that
llama.cpp's own tokenizer gives our ids for any text.

Which llama.cpp tokenizer reproduces ours, by kind:

``sentencepiece`` BPE
    llama.cpp's SPM tokenizer (``tokenizer.ggml.model = "llama"``): the pieces, their scores
    and types (normal, unknown, control, user-defined, unused, byte: sentencepiece's own
    numbering, which GGUF shares). Both merge the best-scored adjacent pair first (the leftmost
    of equals), fall back to ``<0xNN>`` byte pieces, keep user-defined pieces whole and read a
    control piece typed in text (``</s>``) as text. ``add_space_prefix`` is the model's
    ``add_dummy_prefix``. llama.cpp's SPM tokenizer does not normalize, so a model whose
    normalizer changes text (a precompiled NFKC map, extra-whitespace removal) is refused.
``char``
    the same SPM tokenizer with one piece per character (a space written as ``▁``, which
    llama.cpp puts for spaces), no merges possible: every character its own id.

No BOS or EOS is added to a prompt (``add_bos_token``/``add_eos_token`` false): our language
models are trained on text without them (documents are separated by the end-of-text token,
which is also named bos, GPT-2's convention: :func:`~yamlformer.builder.hf.tokenizer.client_specials`).
``tokenizers`` (a Hugging Face ``tokenizer.json``, imported) of GPT-2's byte-level BPE
    llama.cpp's gpt2 tokenizer with ``tokenizer.ggml.pre = "gpt-2"`` (GPT-2's split): the
    vocabulary by id, the merges in rank order, added tokens as control (special) or
    user-defined pieces, a BOS when its post-processor puts one first. A special token typed in
    text is read as that token when the tokenizer does so (:func:`parse_special`: llama.cpp's
    ``special=True``). Any other normalizer, split or post-processor is refused, as is a
    sentencepiece-style ``tokenizer.json`` and a sentencepiece unigram model (llama.cpp's UGM
    tokenizer is not proven here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from yamlformer.builder.hf.tokenizer import CHAR_EOS, client_specials

# sentencepiece ModelProto.SentencePiece.Type = GGUF's token types
_NORMAL, _CONTROL, _BPE = 1, 3, 2
_SPACE = "\u2581"


class VocabError(ValueError):
    """A tokenizer llama.cpp's tokenizers do not reproduce: one line naming why."""


def check_vocab(state: Mapping | None) -> str:
    """What llama.cpp will tokenize ``state`` as (a short phrase), or :class:`VocabError`;
    reads nothing heavy, so export refuses before writing."""
    if state is None:
        return "no tokenizer (token ids only; give --tokenizer to write one)"
    kind = state.get("type")
    if kind == "char":
        chars = state["chars"]
        if _SPACE in chars and " " in chars:
            raise VocabError("tokenizer: a char vocabulary holding both ' ' and '\u2581' (llama.cpp reads both as one)")
        return f"char ({len(chars)} characters) as llama.cpp's SPM tokenizer"
    if kind == "sentencepiece":
        proto = _proto(state)
        trainer, norm = proto.trainer_spec, proto.normalizer_spec
        if trainer.model_type != _BPE:
            raise VocabError(
                "tokenizer: a sentencepiece unigram model; llama.cpp's SPM tokenizer merges pairs (BPE), "
                "and its UGM tokenizer is not proven here"
            )
        if norm.precompiled_charsmap:
            raise VocabError(
                f"tokenizer: the sentencepiece normalizer {norm.name or 'precompiled map'!r}; "
                "llama.cpp's SPM tokenizer does not normalize text (identity only)"
            )
        if norm.remove_extra_whitespaces:
            raise VocabError(
                "tokenizer: the sentencepiece normalizer removes extra whitespace; llama.cpp's SPM tokenizer keeps it"
            )
        if not norm.escape_whitespaces:
            raise VocabError("tokenizer: the sentencepiece model keeps spaces unescaped; llama.cpp's escapes them")
        return f"sentencepiece BPE ({len(proto.pieces)} pieces) as llama.cpp's SPM tokenizer"
    if kind == "tokenizers":
        data, bos = _byte_level(state)
        return f"byte-level BPE ({len(data['model']['vocab'])} tokens) as llama.cpp's gpt2 tokenizer, pre gpt-2"
    raise VocabError(f"tokenizer: of type {str(kind)[:40]!r}, none of char, sentencepiece")


def parse_special(state: Mapping | None) -> bool:
    """Whether our tokenizer reads a special token typed in text as that token (an imported
    tokenizer.json without ``split_special_tokens``): llama.cpp's ``tokenize(..., special=True)``.
    Sentencepiece and char tokenizers read it as text (``special=False``)."""
    return state is not None and state.get("type") == "tokenizers" and not state.get("split_special_tokens", False)


#: the GPT-2 pre-tokenizer regex (tokenizers' ByteLevel with use_regex), which llama.cpp's
#: ``tokenizer.ggml.pre = "gpt-2"`` splits by
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _byte_level(state: Mapping) -> tuple[dict, int | None]:
    """A ``tokenizer.json`` llama.cpp's gpt2 tokenizer reproduces (GPT-2's byte-level BPE: no
    normalizer, GPT-2's split, no prefix space), and the BOS id its post-processor puts first
    (None: nothing added); else :class:`VocabError` naming the part llama.cpp lacks."""

    data = json.loads(state["json"])
    model = data.get("model") or {}
    where = "tokenizer (tokenizer.json)"
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("ignore_merges"):
        raise VocabError(
            f"{where}: model {model.get('type')!r}{' with byte fallback' if model.get('byte_fallback') else ''}"
            f"{' ignoring merges' if model.get('ignore_merges') else ''}; only GPT-2's byte-level BPE is written "
            "(a sentencepiece-style tokenizer.json: export the checkpoint that holds the sentencepiece model)"
        )
    if data.get("normalizer") is not None:
        raise VocabError(f"{where}: a normalizer ({data['normalizer'].get('type')}); llama.cpp's gpt2 has none")
    pre = data.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        plain = split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
        if not (plain and regex == GPT2_SPLIT and byte_level.get("use_regex") is False):
            pre = {"type": "other"}
        else:
            pre = byte_level | {"use_regex": True}
    if pre.get("type") != "ByteLevel" or pre.get("use_regex") is False or pre.get("add_prefix_space"):
        raise VocabError(
            f"{where}: pre-tokenizer {pre.get('type')!r}; llama.cpp's gpt2 pre-tokenizer is GPT-2's byte-level "
            "split without a prefix space (other splits are not mapped to llama.cpp's names yet)"
        )
    post = data.get("post_processor")
    bos = None
    if post is not None and post.get("type") == "TemplateProcessing":
        single = post.get("single") or []
        if len(single) == 2 and "SpecialToken" in single[0] and "Sequence" in single[1]:
            token = single[0]["SpecialToken"]["id"]
            bos = next((t["id"] for t in data.get("added_tokens", []) if t["content"] == token), None)
        if bos is None:
            raise VocabError(f"{where}: a post-processor template llama.cpp cannot add (a BOS alone at most)")
    elif post is not None and post.get("type") not in ("ByteLevel",):
        raise VocabError(f"{where}: post-processor {post.get('type')!r}; llama.cpp adds a BOS at most")
    return data, bos


def _byte_level_vocab(writer, state: Mapping, vocab_size: int) -> None:
    data, bos = _byte_level(state)
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, _NORMAL)
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added.get("special") else 4  # user-defined
    if max(by_id) >= vocab_size:
        raise VocabError(f"tokenizer: token id {max(by_id):,} is past the model's vocab_size {vocab_size:,}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [types.get(i, 5) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    specials = client_specials(dict(state), "decoder-only")
    for name, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if name in specials:
            add(specials[name][1])
    if bos is not None:
        writer.add_bos_token_id(bos)
    writer.add_add_bos_token(bos is not None)
    writer.add_add_eos_token(False)


def _proto(state: Mapping):
    # local: the tokenizer libraries load when a tokenizer is converted
    from yamlformer.builder.hf.tokenizer import _proto as parse

    return parse(state["model_proto"])


def write_vocab(writer, state: Mapping | None, vocab_size: int) -> None:
    """Add ``state``'s tokenizer to ``writer`` (a ``gguf.GGUFWriter``), padded with unused
    pieces up to the model's ``vocab_size`` (its embedding rows); nothing when ``state`` is None."""
    check_vocab(state)
    if state is None:
        writer.add_tokenizer_model("none")
        return
    if state["type"] == "tokenizers":
        _byte_level_vocab(writer, state, vocab_size)
        if state.get("chat_template"):
            writer.add_chat_template(state["chat_template"])
        return
    if state["type"] == "char":
        chars = state["chars"]
        tokens = [_SPACE if c == " " else c for c in chars]
        scores = [0.0] * len(tokens)
        types = [_CONTROL if c == CHAR_EOS else _NORMAL for c in chars]
        add_space_prefix = False
    else:
        proto = _proto(state)
        tokens = [p.piece for p in proto.pieces]
        scores = [float(p.score) for p in proto.pieces]
        types = [int(p.type) for p in proto.pieces]
        add_space_prefix = bool(proto.normalizer_spec.add_dummy_prefix)
    if len(tokens) > vocab_size:
        raise VocabError(f"tokenizer: {len(tokens):,} tokens, more than the model's vocab_size {vocab_size:,}")
    for i in range(len(tokens), vocab_size):  # rows no token reaches: llama.cpp needs one token per row
        tokens.append(f"[PAD{i}]")
        scores.append(-1e9)
        types.append(5)  # unused
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(add_space_prefix)
    specials = client_specials(dict(state), "decoder-only")
    for name, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if name in specials:
            add(specials[name][1])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if state.get("chat_template"):
        writer.add_chat_template(state["chat_template"])
