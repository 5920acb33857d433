"""The corpus of an LM or MLM recipe: every entry of its data section opened as a
:class:`~yamlformer.recipes.data.mixture.Source` (training and validation token streams), with the tokenizer
they share.

An entry is, by what its path holds: a tokenized dataset (``builder tokenize``'s folder: its
split and tokenizer), a Megatron-LM dataset (``.bin``/``.idx``), a raw token file (``.bin``), or
text (files, folders, a dataset by name). Text goes through the same format as everything else:
tokenized once into ``cache_dir/tokenized/`` (keyed by the text, the tokenizer and the split) and
read from there. Unweighted text entries form one source, as one corpus; a weighted one is its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from yamlformer.builder.outputs import shown
from yamlformer.builder.paths import error_problem, path_problem
from yamlformer.recipes.data import registry as datasets
from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.data.megatron import Part, megatron_prefix, read_megatron, read_raw
from yamlformer.recipes.data.mixture import NO_VALIDATION, Source, Stream, epochs_seen, shares
from yamlformer.recipes.data.section import DataSection, SourceEntry
from yamlformer.recipes.data.tokenized import TokenizedDataset, is_tokenized_dataset
from yamlformer.recipes.data.walk import Seen, walk
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import resolve

#: text with at least this many documents is split by document; with fewer, by its tail
DOCUMENT_SPLIT_MIN = 20


#: the version of what a text index records (:func:`read_text`)
TEXT_INDEX_VERSION = 1


class TextCorpus:
    """The text of a recipe's text sources: its files, the hash and the length of what they hold,
    and the texts, read when first asked (a rerun whose text is tokenized already never asks)."""

    def __init__(self, files: list[str], hash: str, chars: int, texts: list[str] | None = None, read=None):
        self.files, self.hash, self.chars = files, hash, chars
        self._texts, self._read = texts, read

    @property
    def texts(self) -> list[str]:
        if self._texts is None:
            self._texts = self._read()
        return self._texts

    @property
    def text(self) -> str:
        return "\n".join(self.texts)


@dataclasses.dataclass
class Corpus:
    """The sources of a recipe's data, opened, with their tokenizer and an identity for resumes."""

    sources: list[Source]
    labels: list[str]  # where each source is written in the recipe: data.dataset, data.sources[2]
    tokenizer: object
    hash: str
    line: str  # the one-line summary a run prints


def _text_files(source: str, section: DataSection, recipe_file: Path | None, seen: Seen) -> list[Path]:
    """The files of one source in reading order, each real file once over the sources ``seen``
    has walked (:mod:`yamlformer.recipes.data.walk`: links followed, loops read once)."""
    if source in datasets.DATASETS:  # a name wins over a file of that name: write ./name for the file
        return [f for f in datasets.text_files(source, section.dataset_root(recipe_file)) if seen.first(f)]
    path = resolve(recipe_file, source)
    if path.is_file() and path_problem(path) is None:
        return [path] if seen.first(path) else []
    if path.is_dir() and path_problem(path, folder=True) is None:
        found = [f for f in walk(path, seen) if any(f.relative_to(path).match(p) for p in section.include)]
        if not found and not any(any(f.relative_to(path).match(p) for p in section.include) for f in walk(path)):
            raise RecipeError(
                f"data.sources: the folder {shown(path)} holds no file matching data.include {list(section.include)}"
            )
        return found  # (empty: every file read already through an earlier source)
    why = path_problem(path, folder=True) or "is neither a file nor a folder"
    raise RecipeError(f"data.sources: {shown(path)}: {why}")


def read_text(paths: list[str], section: DataSection, recipe_file: Path | None) -> TextCorpus:
    """The text of ``paths`` (files, folders, dataset names), a document per file, in order, cut
    off at ``section.max_bytes`` in all.

    The hash of the text is recorded in ``cache_dir/text-index/``, keyed by the files' paths,
    sizes and modification times (as ``datasets`` fingerprints local files): while none of them
    changes, the text is not read again to find its tokenized cache (each ``builder eval`` read
    and hashed the whole corpus, twice). The texts are read when first asked for."""
    seen = Seen()
    candidates = [path for source in paths for path in _text_files(source, section, recipe_file, seen)]
    index = _text_index(candidates, section)
    recorded = _recorded(index)
    if recorded is not None:
        return TextCorpus(
            [str(p) for p in candidates[: recorded["files"]]],
            recorded["hash"],
            recorded["chars"],
            read=lambda: _read_texts(candidates, section.max_bytes),
        )
    texts = _read_texts(candidates, section.max_bytes)
    if not any(t.strip() for t in texts):
        raise RecipeError(f"data {paths} holds no text")
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()[:16]
    chars = sum(map(len, texts))
    if index is not None:
        with contextlib.suppress(RecipeError):  # a cache that cannot be written only costs a read next time
            record = {"version": TEXT_INDEX_VERSION, "files": len(texts), "hash": digest, "chars": chars}
            write_atomic(index, json.dumps(record).encode())
    return TextCorpus([str(p) for p in candidates[: len(texts)]], digest, chars, texts)


def _read_texts(files: list[Path], max_bytes: int | None) -> list[str]:
    """Each file's text in order, until ``max_bytes`` characters are read in all."""
    texts: list[str] = []
    size = 0
    for path in files:
        if max_bytes is not None and size >= max_bytes:
            break
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:  # a file of a folder that cannot be read
            raise RecipeError(f"data.sources: {shown(path)}: {error_problem(exc, path)}") from None
        if max_bytes is not None:
            text = text[: max_bytes - size]
        texts.append(text)
        size += len(text)
    return texts


def _text_index(files: list[Path], section: DataSection) -> Path | None:
    """Where the hash of these files' text is recorded: named by their paths, sizes and times."""
    if section.cache_dir is None:
        return None
    try:
        stats = [(str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]
    except OSError:
        return None
    key = json.dumps([TEXT_INDEX_VERSION, section.max_bytes, stats]).encode()
    return Path(section.cache_dir) / "text-index" / f"{hashlib.sha256(key).hexdigest()[:24]}.json"


def _recorded(index: Path | None) -> dict | None:
    try:
        record = json.loads(index.read_text(encoding="utf-8")) if index is not None else None
    except (OSError, ValueError):
        return None  # none yet, or damaged: read the text
    keys = {"version": int, "files": int, "hash": str, "chars": int}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in keys.items()):
        return None
    return record if record["version"] == TEXT_INDEX_VERSION else None


def read_corpus(section: DataSection, recipe_file: Path | None) -> TextCorpus:
    """Every text entry of ``section`` (what a tokenizer is trained on)."""
    return read_text(
        [e.path for e in section.entries() if kind_of(e, section, recipe_file)[0] == "text"], section, recipe_file
    )


def kind_of(entry: SourceEntry, section: DataSection, recipe_file: Path | None) -> tuple[str, Path | None]:
    """``(tokenized | megatron | raw | text, path)`` of an entry, by what its path holds."""

    if entry.path in datasets.DATASETS:
        return "text", None
    path = resolve(recipe_file, entry.path)
    if path.is_dir() and is_tokenized_dataset(path):
        return "tokenized", path
    prefix = megatron_prefix(path)
    if prefix is not None:
        return "megatron", prefix
    if path.is_file() and path.suffix == ".bin":
        return "raw", path
    return "text", path


def tail_split(part: Part, fraction: float) -> tuple[Part, Part]:
    """The first ``1 - fraction`` of a part's tokens for training, the rest held out, cut at the
    document end nearest below when the part has documents."""
    cut = int(len(part.tokens) * (1 - fraction))
    if part.ends is not None and len(part.ends) > 1:
        below = part.ends[part.ends <= cut]
        cut = int(below[-1]) if len(below) and below[-1] > 0 else cut
    ends = part.ends
    train_ends = None if ends is None else ends[ends <= cut]
    val_ends = None if ends is None else ends[ends > cut] - cut
    return part.take(0, cut, train_ends), part.take(cut, len(part.tokens), val_ends)


def _stream(parts: list[Part], seq_len: int, shift: bool = False) -> Stream:
    return Stream(parts, seq_len, shift)


def _dataset_parts(dataset, split: str) -> list[Part]:
    return [Part(shard.tokens, shard.ends, shard.path) for shard in dataset.shards(split)]


def _held_out(entry, main: list[Part], open_parts, section: DataSection, recipe_file):
    """``(training parts, validation parts)``: ``entry.validation`` opened whole, else each part's tail."""
    if entry.validation is not None:
        return main, open_parts(resolve(recipe_file, entry.validation))
    pairs = [tail_split(p, section.val_fraction) for p in main]
    return [t for t, _ in pairs], [v for _, v in pairs]


def _token_file(kind: str, entry: SourceEntry):
    if kind == "megatron":
        return lambda path: [read_megatron(megatron_prefix(path) or path)]
    return lambda path: [read_raw(path, entry.dtype)]


def _identity(kind: str, path: Path) -> str:
    if kind == "tokenized":
        return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()[:16]
    files = [path.with_suffix(".idx"), path.with_suffix(".bin")] if kind == "megatron" else [path]
    return "|".join(f"{f.name}:{f.stat().st_size}" for f in files)


def text_dataset(text: TextCorpus, tokenizer, section: DataSection, name: str):
    """``text`` tokenized into the cache (once per text, tokenizer and split), opened."""
    # local: the tokenizing machinery (its workers, the tokenizer libraries) loads only when text is tokenized
    from yamlformer.recipes.data.sources import Document
    from yamlformer.recipes.data.tokenize import tokenize_documents

    key = hashlib.sha256(f"{text.hash}|{tokenizer.fingerprint()}|{section.val_fraction}|split-v1".encode())
    folder = Path(section.cache_dir) / "tokenized" / key.hexdigest()[:16]
    if is_tokenized_dataset(folder) and (folder / "manifest.json").is_file():
        return TokenizedDataset.open(folder, tokenizer.fingerprint())
    if len(text.texts) >= DOCUMENT_SPLIT_MIN:
        documents = [Document(t, None, f) for t, f in zip(text.texts, text.files)]
        val_fraction = section.val_fraction
    else:  # too few documents to hold some out whole: the tail of the text, as nanoGPT splits
        joined = text.text
        cut = int(len(joined) * (1 - section.val_fraction))
        documents = [Document(joined[:cut], "train", name), Document(joined[cut:], "validation", name)]
        val_fraction = 0.0
    return tokenize_documents(
        documents,
        tokenizer,
        folder,
        workers=1,
        val_fraction=val_fraction,
        sources=[{"path": name, "format": "text", "bytes": text.chars, "documents": len(text.files)}],
        progress=True,
        wait=True,  # runs started together (a study's trials) share the cache: one tokenizes, the rest wait
    )


def document_tokens(text: TextCorpus, tokenizer, cache_dir: str | Path) -> np.ndarray:
    """Every document of ``text`` tokenized, each followed by the tokenizer's EOS when it has one,
    as one int64 array (``builder eval --data``); tokenized once into ``cache_dir/tokenized/``
    (keyed by the text and the tokenizer) and read from there after."""
    # local: the tokenizing machinery (its workers, the tokenizer libraries) loads only when text is tokenized
    from yamlformer.recipes.data.sources import Document
    from yamlformer.recipes.data.tokenize import tokenize_documents

    key = hashlib.sha256(f"{text.hash}|{tokenizer.fingerprint()}|documents-v1".encode()).hexdigest()
    folder = Path(cache_dir) / "tokenized" / key[:16]
    if is_tokenized_dataset(folder) and (folder / "manifest.json").is_file():
        dataset = TokenizedDataset.open(folder, tokenizer.fingerprint())
    else:
        dataset = tokenize_documents(
            [Document(t, "train", f) for t, f in zip(text.texts, text.files)],
            tokenizer,
            folder,
            sources=[{"path": "eval", "format": "text", "bytes": text.chars, "documents": len(text.files)}],
            progress=False,
            wait=True,
        )
    return np.concatenate([np.asarray(shard.tokens, dtype=np.int64) for shard in dataset.shards("train")])


def _entries(section: DataSection, recipe_file: Path | None) -> tuple[list[SourceEntry], list[str], list[tuple]]:
    """The entries of ``section``, where each is written (``data.dataset``, ``data.sources[2]``) and
    its :func:`kind_of`."""
    entries = section.entries()
    labels = (["data.dataset"] if section.dataset is not None else []) + [
        f"data.sources[{i}]" for i in range(len(section.sources))
    ]
    return entries, labels, [kind_of(e, section, recipe_file) for e in entries]


def _token_parts(
    entry: SourceEntry, kind: str, path: Path, section: DataSection, recipe_file, fingerprint: str, vocab_size: int
):
    """``(training parts, validation parts)`` of an entry that is tokens already (a tokenized
    dataset, a Megatron-LM dataset, a raw token file), opened memory-mapped as a run reads them:
    a tokenized dataset's against the run's tokenizer ``fingerprint``, a token file's ids against
    its ``vocab_size``."""

    if kind == "tokenized":
        dataset = TokenizedDataset.open(path, fingerprint)
        train, validation = _dataset_parts(dataset, "train"), _dataset_parts(dataset, "validation")
        if entry.validation is not None:
            other = TokenizedDataset.open(resolve(recipe_file, entry.validation), fingerprint)
            validation = _dataset_parts(other, "train") + _dataset_parts(other, "validation")
        elif not validation:  # tokenized with no split held out: the tail of its last shard, at a document end
            last, held = tail_split(train[-1], section.val_fraction)
            train, validation = [*train[:-1], last], [held]
        return train, validation
    read = _token_file(kind, entry)
    train, validation = _held_out(entry, read(path), read, section, recipe_file)
    _check_ids(train, vocab_size, entry.path)
    return train, validation


def _source(entry: SourceEntry, name: str, train: list[Part], validation: list[Part], seq_len: int) -> Source:
    held = _stream(validation, seq_len) if validation else None
    return Source(name, _stream(train, seq_len, shift=True), held, entry.weight, entry.max_epochs)


def open_corpus(
    section: DataSection, recipe_file: Path | None, tokenizer_for: Callable, trains_tokenizer: bool, pretrained=None
) -> Corpus:
    """The recipe's sources opened. ``tokenizer_for(text, text_hash)``: the recipe's tokenizer
    (``trains_tokenizer``: it is made from the text); ``pretrained``: one that must be used
    (``init_from``'s); a tokenized dataset's own tokenizer wins over both (and must match them)."""

    entries, labels, kinds = _entries(section, recipe_file)
    opened = {i: TokenizedDataset.open(path) for i, (kind, path) in enumerate(kinds) if kind == "tokenized"}
    tokenizer = _shared_tokenizer(opened, labels, pretrained)
    text_entries = [i for i, (kind, _) in enumerate(kinds) if kind == "text"]
    text_all = read_text([entries[i].path for i in text_entries], section, recipe_file) if text_entries else None
    if tokenizer is None:
        if text_all is None and trains_tokenizer:
            raise RecipeError(NO_TOKENIZER)
        tokenizer = tokenizer_for(text_all.text if text_all else "", text_all.hash if text_all else "")

    sources, source_labels, identities = [], [], []
    unweighted_text = [i for i in text_entries if entries[i].weight is None]
    for i, entry in enumerate(entries):
        kind, path = kinds[i]
        if kind == "text" and i in unweighted_text and i != unweighted_text[0]:
            continue  # read with the first unweighted text entry, as one corpus
        if kind == "text":
            group = unweighted_text if i in unweighted_text else [i]
            # the text of every text entry, read above, when this group is all of them
            same = group == text_entries and text_all is not None
            text = text_all if same else read_text([entries[j].path for j in group], section, recipe_file)
            dataset = text_dataset(text, tokenizer, section, entry.path)
            train, validation = _dataset_parts(dataset, "train"), _dataset_parts(dataset, "validation")
            identities.append(text.hash)
            name = entry.path if len(group) == 1 else f"text ({len(text.files)} files)"
        else:
            train, validation = _token_parts(
                entry, kind, path, section, recipe_file, tokenizer.fingerprint(), tokenizer.vocab_size
            )
            identities.append(_identity(kind, path))
            name = entry.path
        sources.append(_source(entry, name, train, validation, section.seq_len))
        source_labels.append(labels[i])
    check_windows(sources, source_labels, section.seq_len)
    digest = hashlib.sha256("|".join(identities).encode()).hexdigest()[:16]
    return Corpus(sources, source_labels, tokenizer, digest, _summary(sources, text_all, tokenizer))


#: a corpus of token files only, and no tokenizer named to read them with
NO_TOKENIZER = (
    "data: Megatron-LM and raw token files carry no tokenizer; set tokenizer.model_file "
    "(and tokenizer.type) to the tokenizer they were made with"
)


def check_windows(sources: list[Source], labels: list[str], seq_len: int, complete: bool = True) -> None:
    """Every source has a training window and (``complete``: every source of the corpus is here)
    one of them a validation window; else one line naming the source and what to change."""
    for source, label in zip(sources, labels):
        if source.train.n_windows == 0:
            raise RecipeError(
                f"{label}: {source.name} has {source.train.n_tokens:,} training tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; add data or lower data.seq_len"
            )
    if complete and not any(s.validation is not None and s.validation.n_windows > 0 for s in sources):
        raise RecipeError(NO_VALIDATION)


def check_sources(
    section: DataSection,
    recipe_file: Path | None,
    vocab_size: int,
    total_windows: int | None,
    trains_tokenizer: bool,
    pretrained=None,
) -> None:
    """What :func:`open_corpus` and the windows a run draws refuse, found without tokenizing any
    text: each text source a file or a folder of files; each source that is tokens already opened
    as a run opens it (one tokenizer for the tokenized datasets, ``pretrained``'s when given; ids
    inside ``vocab_size``; a training window), when every source is tokens a validation window,
    and when their shares are known (every source tokens, or weighted) none seen past its
    ``max_epochs`` in ``total_windows`` (None: not checked). ``trains_tokenizer``:
    the recipe's tokenizer is made from the text (as :func:`open_corpus` takes it)."""

    entries, labels, kinds = _entries(section, recipe_file)
    opened = {i: TokenizedDataset.open(path) for i, (kind, path) in enumerate(kinds) if kind == "tokenized"}
    shared = _shared_tokenizer(opened, labels, pretrained)
    if shared is None and trains_tokenizer and all(kind != "text" for kind, _ in kinds):
        raise RecipeError(NO_TOKENIZER)
    fingerprint = shared.fingerprint() if shared is not None else None
    sources, source_labels, complete, seen = [], [], True, Seen()
    for i, entry in enumerate(entries):
        kind, path = kinds[i]
        if kind == "text":
            if entry.path not in datasets.DATASETS:  # a dataset's files: the registry's (the dry run's data lines)
                _text_files(entry.path, section, recipe_file, seen)
            complete = False  # its tokens are known once it is tokenized
            continue
        train, validation = _token_parts(entry, kind, path, section, recipe_file, fingerprint, vocab_size)
        sources.append(_source(entry, entry.path, train, validation, section.seq_len))
        source_labels.append(labels[i])
    check_windows(sources, source_labels, section.seq_len, complete)
    weights = [e.weight for e in entries]
    if total_windows is not None and (complete or all(w is not None for w in weights)):  # the shares are known
        p = None if complete else [s.weight / sum(weights) for s in sources]
        problems = over_limit(_rows(source_labels, sources, total_windows, p))
        if problems:
            raise RecipeError(problems[0])


def _shared_tokenizer(opened: dict, labels: list[str], pretrained):
    """The tokenizer the tokenized datasets were made with (the same for all), checked against
    ``pretrained``; ``pretrained`` when there are none."""
    if not opened:
        return pretrained
    first, *rest = opened.items()
    tokenizer = first[1].tokenizer()
    for i, dataset in rest:
        if dataset.tokenizer().fingerprint() != tokenizer.fingerprint():
            raise RecipeError(
                f"{labels[i]}: {dataset.folder} was tokenized with another tokenizer than "
                f"{labels[first[0]]} ({first[1].folder}); tokenize both with one"
            )
    if pretrained is not None and pretrained.fingerprint() != tokenizer.fingerprint():
        raise RecipeError(
            f"{labels[first[0]]}: {first[1].folder} was tokenized with another tokenizer than the "
            "weights' (model.init_from); tokenize it with that tokenizer"
        )
    return tokenizer


def _check_ids(parts: list[Part], vocab_size: int, name: str) -> None:
    """A first look at a token file's ids (its first million): all inside the vocabulary."""
    for part in parts:
        head = np.asarray(part.tokens[: 1 << 20])
        if len(head) and int(head.max()) >= vocab_size:
            raise RecipeError(
                f"{name}: token id {int(head.max())} is outside the tokenizer's vocabulary of "
                f"{vocab_size:,} (set tokenizer.model_file to the tokenizer it was made with, or "
                "the source's dtype)"
            )


def _summary(sources: list[Source], text: TextCorpus | None, tokenizer) -> str:
    kind = f"{tokenizer.kind}, vocab {tokenizer.vocab_size:,}"
    train = sum(s.train.n_tokens for s in sources)
    held = sum(s.validation.n_tokens for s in sources if s.validation is not None)
    if len(sources) == 1 and text is not None:
        return (
            f"corpus: {len(text.files)} files, {text.chars:,} chars -> {train + held:,} tokens, "
            f"{train:,} for training ({kind})"
        )
    return f"corpus: {len(sources)} sources, {train:,} training and {held:,} validation tokens ({kind})"


def mixture_rows(corpus: Corpus, total_windows: int) -> list[dict]:
    """Per source: its training tokens, its share of the windows and the passes a run of
    ``total_windows`` makes over it, with its limit."""
    return _rows(corpus.labels, corpus.sources, total_windows)


def _rows(labels: list[str], sources: list[Source], total_windows: int, p=None) -> list[dict]:
    """:func:`mixture_rows` of ``sources`` (``p``: their shares, when not :func:`shares` of these alone)."""
    p = shares(sources) if p is None else p
    rows = []
    for label, source, share, epochs in zip(labels, sources, p, epochs_seen(sources, total_windows, p)):
        rows.append(
            {
                "source": label,
                "name": source.name,
                "tokens": source.train.n_tokens,
                "share": float(share),
                "epochs": epochs,
                "max_epochs": source.max_epochs,
            }
        )
    return rows


def over_limit(rows: list[dict]) -> list[str]:
    """One line for each source the run would pass over more often than its ``max_epochs``."""
    return [
        f"{r['source']}.max_epochs: {r['name']} would be seen {r['epochs']:.2f} times (limit {r['max_epochs']:g}); "
        "lower its weight or trainer.max_steps, or raise the limit"
        for r in rows
        if r["max_epochs"] is not None and r["epochs"] > r["max_epochs"]
    ]


def source_tokens(entry: SourceEntry, kind: str, path: Path, section: DataSection) -> int:
    """The training tokens of a source that is already tokens, read from its header or manifest
    (what the dry run shows; a tail held out as the run holds it)."""

    if kind == "tokenized":
        return TokenizedDataset.open(path).tokens("train")
    part = read_megatron(path) if kind == "megatron" else read_raw(path, entry.dtype)
    if entry.validation is not None:
        return len(part.tokens)
    return len(tail_split(part, section.val_fraction)[0].tokens)


def held_out_tokens(corpus: Corpus) -> np.ndarray:
    """Every source's validation tokens, one after another (what ``builder eval --all`` scores)."""
    parts = [p.tokens for s in corpus.sources if s.validation is not None for p in s.validation.parts]
    return np.concatenate([np.asarray(t) for t in parts])
