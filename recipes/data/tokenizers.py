"""Text to token ids: a character table, a sentencepiece model trained on the corpus, or the
tokenizer of a Hugging Face folder.

Each kind encodes one text (``encode``), a batch of documents (``encode_batch``, what ``builder
tokenize`` calls) and a whole corpus in chunks (``encode_corpus``), and names its end-of-document
id (``eos_id``: every tokenizer a recipe trains has one; a Hugging Face one may not, an old char
table has none). ``encode_batch`` uses the library's threads unless ``TOKENIZERS_PARALLELISM``
is false in the environment (the ``tokenizers`` library's switch, which sentencepiece batches
here follow too): each ``builder tokenize`` worker sets it, so W workers use W cores.

A tokenizer's ``state()`` is small plain data (the character list, the sentencepiece model's
bytes, or a ``tokenizer.json``; the format is defined in :mod:`yamlformer.builder.hf.tokenizer`, which also
writes each kind as a Hugging Face tokenizer) that goes into every checkpoint, so ``builder
eval`` and ``builder generate`` need only the checkpoint. Trained sentencepiece models are cached
by the hash of corpus and settings.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from yamlformer.builder.hf import HFError
from yamlformer.builder.hf.tokenizer import CHAR_EOS, read_tokenizer, to_tokenizers
from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.data.section import TokenizerSection
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import resolve

#: text per sentencepiece encode call; cut at newlines, which no piece crosses
_CHUNK_CHARS = 1 << 16
#: what TOKENIZERS_PARALLELISM says when it turns a library's threads off (the tokenizers crate's list)
_OFF = ("", "off", "false", "f", "no", "n", "0")
#: the spellings of an end-of-text token a tokenizer.json without named specials may hold
EOS_SPELLINGS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def _library_threads() -> bool:
    """Whether encode_batch may use the library's thread pool (see the module docstring)."""
    value = os.environ.get("TOKENIZERS_PARALLELISM")
    return value is None or value.strip().lower() not in _OFF


class CharTokenizer:
    """One id per distinct character of the corpus, in sorted order (nanoGPT's shakespeare_char),
    and, in the tables recipes fit, ASCII's end-of-text character (``CHAR_EOS``, U+0003) after
    them as the end-of-document token: the LM's documents are separated by it, and an exported
    model names it bos and eos."""

    kind = "char"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def fit(cls, text: str, eos: bool = False) -> CharTokenizer:
        """The table of ``text``'s characters; ``eos``: with the end-of-text character last."""
        return cls([*sorted(set(text) - {CHAR_EOS}), CHAR_EOS] if eos else sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as exc:
            raise RecipeError(f"character {exc.args[0]!r} is not in this char tokenizer's vocabulary") from None

    @property
    def eos_id(self) -> int | None:
        return self.index.get(CHAR_EOS)  # None in a table without one (fitted before recipes added it)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        index = self.index
        try:
            return [[index[c] for c in text] for text in texts]
        except KeyError as exc:
            raise RecipeError(f"character {exc.args[0]!r} is not in this char tokenizer's vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        """The characters of ``ids``; the end-of-text token is dropped, as sentencepiece drops its."""
        eos = self.eos_id
        return "".join(self.chars[i] for i in ids if i != eos)

    def encode_corpus(self, text: str) -> Iterable[tuple[int, list[int]]]:
        """(characters read, their ids) for successive chunks of ``text``."""
        for start in range(0, len(text), _CHUNK_CHARS):
            chunk = text[start : start + _CHUNK_CHARS]
            yield len(chunk), self.encode(chunk)

    def state(self) -> dict:
        return {"type": "char", "chars": "".join(self.chars)}

    def fingerprint(self) -> str:
        return hashlib.sha256(self.state()["chars"].encode("utf-8")).hexdigest()[:16]


class SentencePieceTokenizer:
    """A sentencepiece model held as its serialized bytes."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):

        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int | None:
        eos = self.sp.eos_id()
        return None if eos < 0 else eos

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=-1 if _library_threads() else 1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(list(ids))

    def encode_corpus(self, text: str) -> Iterable[tuple[int, list[int]]]:
        """(characters read, their ids) for successive chunks of ``text``, cut after newlines."""
        start = 0
        while start < len(text):
            end = text.find("\n", start + _CHUNK_CHARS)
            end = len(text) if end < 0 else end + 1
            yield end - start, self.sp.encode(text[start:end])
            start = end

    def state(self) -> dict:
        return {"type": "sentencepiece", "model_proto": self.model_proto}

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()[:16]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library's format), as read from a
    model folder (``tokenizer.type: hf``). A prompt is encoded as ``transformers`` encodes it,
    with the special tokens its post-processor adds (Llama's ``<s>``); a training corpus without
    them. Decoding drops special tokens, as sentencepiece and the text-generation pipeline do."""

    kind = "tokenizers"

    def __init__(
        self,
        json_text: str,
        specials: dict | None = None,
        split_special_tokens: bool = False,
        chat_template: str | None = None,
    ):

        self.json_text, self.specials, self.split = json_text, dict(specials or {}), split_special_tokens
        self.chat_template = chat_template  # the folder's Jinja chat template (tokenizer_config.json), if any
        self.tokenizer = to_tokenizers(self.state())

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        """The EOS token the folder's specials name, else a special token of tokenizer.json
        spelled as one (:data:`EOS_SPELLINGS`), else None."""
        named = self.specials.get("eos_token")
        if named is not None:
            return self.tokenizer.token_to_id(named)
        special = {token.content for token in self.tokenizer.get_added_tokens_decoder().values() if token.special}
        for text in EOS_SPELLINGS:
            if text in special:
                return self.tokenizer.token_to_id(text)
        return None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text as a training corpus is encoded: no special tokens added (no offsets computed)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_corpus(self, text: str) -> Iterable[tuple[int, list[int]]]:
        """(characters read, their ids) for successive chunks of ``text``, cut after newlines."""
        start = 0
        while start < len(text):
            end = text.find("\n", start + _CHUNK_CHARS)
            end = len(text) if end < 0 else end + 1
            yield end - start, self.tokenizer.encode(text[start:end], add_special_tokens=False).ids
            start = end

    def state(self) -> dict:
        state = {
            "type": "tokenizers",
            "json": self.json_text,
            "specials": self.specials,
            "split_special_tokens": self.split,
        }
        return {**state, "chat_template": self.chat_template} if self.chat_template is not None else state

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.split}|{self.json_text}".encode()).hexdigest()[:16]


Tokenizer = CharTokenizer | SentencePieceTokenizer | HFTokenizer


def from_state(state: dict) -> Tokenizer:
    """The tokenizer a checkpoint recorded (or :func:`yamlformer.builder.hf.tokenizer.read_tokenizer` read)."""
    kind = state.get("type") if isinstance(state, dict) else None
    if kind == "char":
        return CharTokenizer(list(state["chars"]))
    if kind == "tokenizers":
        return HFTokenizer(
            state["json"], state.get("specials"), state.get("split_special_tokens", False), state.get("chat_template")
        )
    if kind == "sentencepiece":
        return SentencePieceTokenizer(state["model_proto"])
    raise ValueError(f"a tokenizer of type {str(kind)[:40]!r} is none of char, sentencepiece, tokenizers")


def hf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder (or an import-hf output), or of a tokenizer.json."""

    try:
        if path.is_file() and path.name.endswith(".json"):
            state = read_tokenizer(path.parent, only=path.name)
        elif path.is_dir():
            state = read_tokenizer(path)
        else:
            raise RecipeError(f"tokenizer.model_file: {path} is neither a model folder nor a tokenizer.json")
    except HFError as exc:
        raise RecipeError(f"tokenizer.model_file: {exc}") from None
    if state is None:
        raise RecipeError(f"tokenizer.model_file: {path} has no tokenizer.json or tokenizer.model")
    return from_state(state)


def train_sentencepiece(text: str, section: TokenizerSection, seed: int = 0, options: dict | None = None) -> bytes:
    """A sentencepiece model for ``text`` that round-trips code: identity normalization, runs of
    spaces kept as pieces, no dummy prefix, byte fallback (newlines and rare characters), and an
    end-of-text piece ``</s>`` (``builder tokenize`` ends each document with it) at the first id
    the other specials leave free. ``options``: trainer settings over these (special-token ids,
    prose normalization...); an ``eos_id`` there, -1 included, is kept."""

    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) > section.train_max_lines:
        lines = random.Random(seed).sample(lines, section.train_max_lines)
    if not lines:
        raise RecipeError("the corpus has no text to train a tokenizer on")
    buffer = io.BytesIO()
    settings = dict(
        vocab_size=section.vocab_size,
        model_type=section.model_type,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=False,
        character_coverage=0.9999,
        max_sentence_length=1 << 14,
        unk_id=0,
        bos_id=-1,
        pad_id=-1,
        num_threads=max(1, min(4, os.cpu_count() or 1)),
        minloglevel=2,
    )
    settings.update(options or {})
    if "eos_id" not in settings:
        taken = {settings[k] for k in ("unk_id", "bos_id", "pad_id")}
        settings["eos_id"] = next(i for i in range(len(taken) + 1) if i not in taken)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buffer, **settings)
    except RuntimeError as exc:  # e.g. a vocabulary smaller than the corpus's characters + 256 bytes
        message = str(exc).split("] ")[-1]
        raise RecipeError(
            f"sentencepiece cannot train tokenizer.vocab_size {section.vocab_size} here: {message}"
        ) from None
    return buffer.getvalue()


def build_tokenizer(
    section: TokenizerSection,
    text: str,
    corpus_hash: str,
    cache_dir: Path,
    recipe_file: Path | None,
    options: dict | None = None,
) -> Tokenizer:
    """The recipe's tokenizer: fitted (char), loaded (model_file) or trained and cached.
    ``options``: sentencepiece trainer settings (see :func:`train_sentencepiece`), part of the cache key."""
    if section.type == "char":
        return CharTokenizer.fit(text, eos=True)
    if section.type == "hf":
        if section.model_file is None:
            raise RecipeError("tokenizer.type hf needs tokenizer.model_file: a model folder or a tokenizer.json")
        return hf_tokenizer(resolve(recipe_file, section.model_file))
    if section.model_file is not None:
        path = resolve(recipe_file, section.model_file)
        if not path.is_file():
            raise RecipeError(f"tokenizer.model_file: {path} does not exist")
        return SentencePieceTokenizer(path.read_bytes())
    extra = f"|{sorted(options.items())}" if options else ""
    key = hashlib.sha256(
        f"{corpus_hash}|{section.model_type}|{section.vocab_size}|{section.train_max_lines}|v2{extra}".encode()
    ).hexdigest()[:16]
    cached = cache_dir / "tokenizers" / f"spm-{section.model_type}-{section.vocab_size}-{key}.model"
    if cached.is_file():
        return SentencePieceTokenizer(cached.read_bytes())
    print(f"training a sentencepiece {section.model_type} tokenizer ({section.vocab_size} pieces) ...", flush=True)
    proto = train_sentencepiece(text, section, options=options)
    write_atomic(cached, proto)
    return SentencePieceTokenizer(proto)
