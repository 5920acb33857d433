"""Tokenizers in Hugging Face folders: ours written as ``tokenizer.json``, theirs read back.

A tokenizer travels as its **state**, small plain data that ``builder train`` stores in every
checkpoint (``checkpoint["builder"]["tokenizer"]``) and that ``yamlformer.recipes.data.tokenizers`` builds its
tokenizer objects from. The three kinds:

``{"type": "char", "chars": "..."}``
    one id per character, in the string's order (nanoGPT's shakespeare_char); ASCII's
    end-of-text character U+0003 among them is the end-of-text token;
``{"type": "sentencepiece", "model_proto": b"..."}``
    a sentencepiece model (BPE or unigram), its serialized ``ModelProto``;
``{"type": "tokenizers", "json": "...", "specials": {"bos_token": "<s>", ...}, "split_special_tokens": false}``
    a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library's format), the special
    tokens its ``tokenizer_config.json`` names and whether special tokens typed in text are
    read as plain text: what ``builder import-hf`` reads from a folder.

:func:`to_tokenizers` turns any state into a ``tokenizers.Tokenizer`` that encodes as ours does:
a sentencepiece model through its own normalizer settings (identity or its precompiled map,
extra-whitespace removal, whitespace escaping, dummy prefix), BPE merges ranked by piece score
(sentencepiece merges the best-scored pair first, the leftmost of equals), unigram pieces with
their scores, byte fallback, user-defined pieces kept whole and control pieces as special
tokens. :func:`write_tokenizer` writes ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` so ``AutoTokenizer.from_pretrained`` loads it (and a sentencepiece
model's ``tokenizer.model``, which llama.cpp's converter reads); :func:`read_tokenizer`
reads a folder's tokenizer as a state.

What a client is told (:func:`client_specials`, one place for the tokenizer files, ``config.json``
and ``generation_config.json``) follows how the model was trained, in each serving library's terms:
a language model's end-of-text token is its bos (and unk) too when it has no other (GPT-2's
convention: the LM's documents are separated by it, so it is what the model saw before each one,
and CTranslate2 refuses a model without a bos or unk); an encoder is told BERT's ``[CLS]``/``[SEP]``/``[MASK]`` and its
text gets them around it, as the encoder recipes train; an encoder-decoder's source ends in eos,
and for a family whose clients start the decoder from the pad token (Pegasus: CTranslate2's
loader hard-codes it) the pad token is the decoder's start token: padding is masked, so it pads too.

Where the two can differ (documented in the README): a unigram text with two segmentations of
exactly equal score (sentencepiece breaks the tie by float32 rounding, ``tokenizers`` by its own
order; both are equally likely under the model), literal text spelling a control or byte piece
(``<s>``, ``<0x41>``) in a unigram model, the text of invalid UTF-8 byte sequences (each side
puts U+FFFD in its own places), and characters outside a char vocabulary (ours refuses them,
the Hugging Face tokenizer drops them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from yamlformer.builder.hf.checks import read_bytes, read_json
from yamlformer.builder.hf.common import HFError

# sentencepiece ModelProto.SentencePiece.Type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# sentencepiece TrainerSpec.ModelType
_UNIGRAM, _BPE = 1, 2
#: the special-token names of tokenizer_config.json and the sentencepiece trainer's ids for them
SPECIALS = {"unk_token": "unk", "bos_token": "bos", "eos_token": "eos", "pad_token": "pad"}
#: the files write_tokenizer writes and read_tokenizer reads
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: a sentencepiece model's own file, which write_tokenizer writes beside them
SENTENCEPIECE_FILE = "tokenizer.model"
#: a char tokenizer's end-of-text token: ASCII's END OF TEXT control character
CHAR_EOS = "\x03"
#: BERT's mask piece, which the encoder recipes' tokenizers hold as a control piece
MASK_PIECE = "[MASK]"


def to_tokenizers(state: dict):
    """A ``tokenizers.Tokenizer`` that encodes and decodes as the tokenizer of ``state`` does."""
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from tokenizers import Tokenizer

    kind = state.get("type")
    if kind == "char":
        return _from_chars(state["chars"])
    if kind == "sentencepiece":
        return from_sentencepiece(state["model_proto"])
    if kind == "tokenizers":
        tokenizer = Tokenizer.from_str(state["json"])
        tokenizer.encode_special_tokens = bool(state.get("split_special_tokens", False))
        return tokenizer
    raise HFError(f"a tokenizer of type {kind!r} has no Hugging Face form (char, sentencepiece, tokenizers)")


def _from_chars(chars: str):
    """One id per character: a BPE without merges (every character its own token) and no
    normalizer or pre-tokenizer, so newlines and runs of spaces are tokens like any other."""
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    if CHAR_EOS in chars:  # the end-of-text character keeps its id and is special (decode drops it)
        tokenizer.add_special_tokens([AddedToken(CHAR_EOS, normalized=False, special=True)])
    return tokenizer


def _proto(model_proto: bytes):
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(bytes(model_proto))
    except Exception:
        raise HFError("not a sentencepiece model, or a damaged one") from None
    if not proto.pieces:
        raise HFError("not a sentencepiece model, or a damaged one (it has no pieces)")
    return proto


def from_sentencepiece(model_proto: bytes):
    """A sentencepiece model (BPE or unigram) as a ``tokenizers.Tokenizer``, following the
    model's own settings (see the module docstring)."""
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = _proto(model_proto)
    trainer, spec, pieces = proto.trainer_spec, proto.normalizer_spec, list(proto.pieces)
    unk = trainer.unk_piece if trainer.unk_id >= 0 else None
    if trainer.model_type == _UNIGRAM:
        model = models.Unigram(
            [(p.piece, p.score) for p in pieces],
            unk_id=trainer.unk_id if unk else None,
            byte_fallback=trainer.byte_fallback,
        )
    elif trainer.model_type == _BPE:
        normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == _NORMAL}
        ranked = []  # a merge's rank: its result's score (best first), then the result's id
        for piece, (score, i) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, i, left, right))
        model = models.BPE(
            vocab={p.piece: i for i, p in enumerate(pieces)},
            merges=[(left, right) for _, _, left, right in sorted(ranked)],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    else:
        raise HFError(f"a sentencepiece model of type {trainer.model_type} (not BPE or unigram) has no conversion here")
    tokenizer = Tokenizer(model)

    steps = []  # sentencepiece's normalizer, in its order
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # spaces only: sentencepiece leaves newlines alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    user_defined = [p.piece for p in pieces if p.type == _USER_DEFINED]
    if user_defined:  # sentencepiece emits them whole and never merges into them
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    steps = [decoders.Replace("\u2581", " ")]
    if trainer.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    controls = [p.piece for p in pieces if p.type == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(c, normalized=False, special=True) for c in controls])
    tokenizer.encode_special_tokens = True  # sentencepiece reads "<s>" in text as text
    return tokenizer


def special_tokens(state: dict) -> dict[str, tuple[str, int]]:
    """``{"bos_token": ("<s>", 1), ...}``: the special tokens a tokenizer state has, with ids."""
    kind = state.get("type")
    if kind == "char":
        chars = state["chars"]
        return {"eos_token": (CHAR_EOS, chars.index(CHAR_EOS))} if CHAR_EOS in chars else {}
    if kind == "sentencepiece":
        trainer = _proto(state["model_proto"]).trainer_spec
        pieces = {
            "unk": trainer.unk_piece,
            "bos": trainer.bos_piece,
            "eos": trainer.eos_piece,
            "pad": trainer.pad_piece,
        }
        out = {}
        for name, short in SPECIALS.items():
            i = getattr(trainer, f"{short}_id")
            if i >= 0:
                out[name] = (pieces[short], i)
        return out
    if kind == "tokenizers":
        tokenizer = to_tokenizers(state)
        return {
            name: (text, tokenizer.token_to_id(text))
            for name, text in (state.get("specials") or {}).items()
            if name in SPECIALS and tokenizer.token_to_id(text) is not None
        }
    return {}


def client_specials(
    state: dict, architecture: str | None = None, start_from_pad: bool = False
) -> dict[str, tuple[str, int]]:
    """The special tokens (name -> (text, id)) an exported folder tells its clients, for a model of
    ``architecture`` (None: as the tokenizer names them); see the module docstring.
    ``start_from_pad``: the family's clients start the decoder from the pad token."""
    specials = dict(special_tokens(state))
    if architecture == "decoder-only" and "eos_token" in specials:
        specials.setdefault("bos_token", specials["eos_token"])
        specials.setdefault("unk_token", specials["eos_token"])  # GPT-2's too; CTranslate2 needs one named
    elif architecture == "encoder-only":
        if "bos_token" in specials and "eos_token" in specials:
            specials["cls_token"], specials["sep_token"] = specials["bos_token"], specials["eos_token"]
        mask = _piece_id(state, MASK_PIECE)
        if mask is not None:
            specials["mask_token"] = (MASK_PIECE, mask)
    elif architecture == "encoder-decoder" and start_from_pad and "bos_token" in specials:
        specials["pad_token"] = specials["bos_token"]
    return specials


def _piece_id(state: dict, piece: str) -> int | None:
    """The id of a control piece of a sentencepiece state (None when it has none)."""
    if state.get("type") != "sentencepiece":
        return None
    for i, p in enumerate(_proto(state["model_proto"]).pieces):
        if p.piece == piece and p.type == _CONTROL:
            return i
    return None


def token_ids(state: dict, architecture: str | None = None, start_from_pad: bool = False) -> dict[str, int]:
    """``config.json``'s ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of a tokenizer state
    (for a model of ``architecture``: :func:`client_specials`)."""
    specials = client_specials(state, architecture, start_from_pad)
    return {
        f"{name.removesuffix('_token')}_token_id": specials[name][1]
        for name in ("bos_token", "eos_token", "pad_token")
        if name in specials
    }


def write_tokenizer(
    state: dict,
    folder: str | Path,
    max_length: int | None = None,
    architecture: str | None = None,
    start_from_pad: bool = False,
) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for
    ``state`` into ``folder``, for ``transformers.AutoTokenizer``; returns the paths.

    The special tokens are :func:`client_specials`' for ``architecture``. Encoding adds what the
    recipes add: nothing to a language model's text, ``[CLS] ... [SEP]`` around an encoder's, eos
    after an encoder-decoder's source. Special tokens typed in text are read as text
    (``split_special_tokens``, as sentencepiece does), and decoding leaves spaces as they are
    (``clean_up_tokenization_spaces: false``). For llama.cpp's ``convert_hf_to_gguf.py``, which
    reads them: ``add_bos_token``/``add_eos_token`` false where nothing is added, and a
    sentencepiece model is written as itself too (``tokenizer.model``) with ``add_prefix_space``
    its ``add_dummy_prefix``.
    """
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from tokenizers import processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kind = state.get("type")
    tokenizer = to_tokenizers(state)
    found = client_specials(state, architecture, start_from_pad)
    specials = {name: text for name, (text, _) in found.items()}
    if architecture == "encoder-decoder" and "eos_token" in found:
        eos = found["eos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {eos[0]}", pair=f"$A {eos[0]} $B {eos[0]}", special_tokens=[eos]
        )
    elif architecture == "encoder-only" and "cls_token" in found:
        cls, sep = found["cls_token"], found["sep_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls[0]} $A {sep[0]}", pair=f"{cls[0]} $A {sep[0]} $B:1 {sep[0]}:1", special_tokens=[cls, sep]
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": bool(state.get("split_special_tokens", True)),
        **specials,
    }
    if architecture is not None:  # what the model takes: generate(**tokenizer(text)) passes nothing else
        segments = ["token_type_ids"] if architecture == "encoder-only" else []
        config["model_input_names"] = ["input_ids", *segments, "attention_mask"]
    if max_length is not None:
        config["model_max_length"] = max_length
    if state.get("chat_template"):  # an imported tokenizer's, carried back
        config["chat_template"] = state["chat_template"]
    if tokenizer.post_processor is None:  # nothing is put around the text: said, so no runtime adds a BOS
        config["add_bos_token"] = config["add_eos_token"] = False
    written = [folder / name for name in FILES]
    if kind == "sentencepiece":  # the model itself too, for llama.cpp's converter (and slow tokenizers)
        config["add_prefix_space"] = bool(_proto(state["model_proto"]).normalizer_spec.add_dummy_prefix)
        written.append(folder / SENTENCEPIECE_FILE)
        written[-1].write_bytes(bytes(state["model_proto"]))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    return written


def read_tokenizer(folder: str | Path, only: str | None = None) -> dict | None:
    """The tokenizer state of a Hugging Face folder: its ``tokenizer.json`` (with the special
    tokens ``tokenizer_config.json`` names) as a ``tokenizers`` state, else a sentencepiece
    ``tokenizer.model`` as a ``sentencepiece`` state, else ``None``. ``only``: read this JSON
    file of the folder instead. Reads only files inside ``folder``; a file that does not load is
    a one-line :class:`HFError` naming it."""
    # local: the tokenizer libraries load when a tokenizer is converted (builder.hf serves torch-free commands)
    from tokenizers import Tokenizer

    folder = Path(folder)
    path = folder / (only or "tokenizer.json")
    if only or path.is_file() or path.is_symlink():
        data = read_json(path, "tokenizer", folder)
        text = json.dumps(data)
        try:
            Tokenizer.from_str(text)
        except Exception as exc:
            raise HFError(
                f"{path}: not a tokenizer the tokenizers library can load ({' '.join(str(exc).split())[:120]})"
            ) from None
        specials, split = _named_specials(folder)
        state = {"type": "tokenizers", "json": text, "specials": specials, "split_special_tokens": split}
        template = chat_template(folder)
        return {**state, "chat_template": template} if template is not None else state
    path = folder / SENTENCEPIECE_FILE
    if path.is_file() or path.is_symlink():
        proto = read_bytes(path, "tokenizer", folder)
        try:
            _proto(proto)  # a damaged file is refused here
        except HFError as exc:
            raise HFError(f"{path}: {exc}") from None
        return {"type": "sentencepiece", "model_proto": proto}
    return None


def chat_template(folder: Path) -> str | None:
    """The folder's chat template (Jinja), as ``transformers`` reads it: ``chat_template.jinja``,
    else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: ``default``);
    None when it has none."""
    path = folder / "chat_template.jinja"
    if path.is_file() or path.is_symlink():
        return read_bytes(path, "config", folder).decode("utf-8", errors="replace")
    path = folder / "tokenizer_config.json"
    if not (path.is_file() or path.is_symlink()):
        return None
    template = read_json(path, "config", folder).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):  # 42: no template (the default was used silently)
        raise HFError(f"{path}: chat_template is a {type(template).__name__}, not a Jinja template")
    return template


def _named_specials(folder: Path) -> tuple[dict[str, str], bool]:
    """The special tokens ``tokenizer_config.json`` (or ``special_tokens_map.json``) names, and
    its ``split_special_tokens``."""
    out: dict[str, str] = {}
    split = False
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if not (path.is_file() or path.is_symlink()):
            continue
        config = read_json(path, "config", folder)
        for key, value in config.items():
            if key in SPECIALS:
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str):
                    out[key] = text
        split = split or config.get("split_special_tokens") is True
    return out, split


def generation_config(ids: dict[str, Any]) -> dict:
    """``generation_config.json``: the token ids that stop and pad generation; greedy unless the
    caller asks for sampling. No ``max_length``: ``generate(max_new_tokens=...)`` would warn that
    both are set (the context length is ``config.json``'s and the tokenizer's
    ``model_max_length``)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id")
    return {k: ids[k] for k in keys if ids.get(k) is not None}
