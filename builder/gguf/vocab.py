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
A Hugging Face ``tokenizer.json`` (an imported tokenizer) and a sentencepiece unigram model are
refused in one line: llama.cpp's byte-level BPE recognises a pre-tokenizer by name and its UGM
tokenizer is not proven here.
"""

from __future__ import annotations

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
        raise VocabError(
            "tokenizer: a Hugging Face tokenizer.json (imported); llama.cpp identifies a byte-level BPE's "
            "pre-tokenizer by name, and no mapping of ours to one is proven yet"
        )
    raise VocabError(f"tokenizer: of type {str(kind)[:40]!r}, none of char, sentencepiece")


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
