"""``builder tokenize``'s pipeline: a stream of documents into a tokenized dataset (the format of
:mod:`yamlformer.recipes.data.tokenized`), in bounded memory, in parallel, resumable. Torch-free.

The stream is cut, in order, into *units* of about ``shard_bytes`` of UTF-8 text (a cut falls
after the document that reaches it), whatever the number of workers; unit ``k`` becomes the shard
``k`` of each split it has documents of. Workers (processes of the ``forkserver`` context where
there is one, else ``spawn``; each builds the tokenizer once from its ``state()`` and encodes on
one thread) tokenize a unit and write its shards themselves (a temp file, fsync, rename), handing
back only their sizes and checksums. The main process reads and splits the stream, keeps at most
two units per worker in flight and records results in unit order, so its memory is a few units,
never the corpus, and every byte written (shards and manifest) is the same for any worker count.
One worker runs in this process. The worker side is :mod:`yamlformer.recipes.data.shards`; the output folder
(lock, settings, leftovers, the tokenizer's file) :mod:`yamlformer.recipes.data.dataset_folder`.

Split: a document goes to validation when ``sha1(its UTF-8 text)``, read as a fraction of 2**64
from its first 8 bytes, is below ``val_fraction``; every document of a source matching one of the
``val_sources`` globs (the path or a folder above it) goes there too, and a document whose
``split`` is set keeps it.

Resume: each finished unit leaves ``.units/NNNNN.json`` (its content hash: the settings, each
document's sha1 and split; and its shards' checksums), written after its shards are on disk. A
rerun reads the stream again and skips every unit whose record matches and whose shards are
intact, without tokenizing it; a shard without its record is never trusted (it is rewritten), and
temp files a killed run left are removed. A folder started with other settings is refused (or,
with ``overwrite``, emptied of what tokenize wrote and started over).
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from yamlformer.recipes.data.dataset_folder import Folder, dumps, save_tokenizer
from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.data.shards import Unit, fsync_folder, one_thread, start_worker, tokenize_unit, work
from yamlformer.recipes.data.sources import Document
from yamlformer.recipes.data.tokenized import (
    FORMAT,
    MANIFEST,
    SPLITS,
    VERSION,
    Stamps,
    TokenizedDataset,
    dtype_for,
    file_sha256,
)
from yamlformer.recipes.errors import RecipeError

#: units in flight per worker
IN_FLIGHT = 2
RULE = (
    "sha1(UTF-8 text)[:8] as a big-endian integer / 2**64 < val_fraction goes to validation; documents of "
    "val_sources (the path or a folder above it matching a glob) and documents given a split keep theirs"
)


# -- the main process ------------------------------------------------------------------------------


class _Splitter:
    """Which split each document goes to (see the module docstring)."""

    def __init__(self, val_fraction: float, val_sources: list[str]):
        self.threshold = int(val_fraction * 2**64)
        self.patterns = list(val_sources)
        self._held: dict[str, bool] = {}

    def held_out(self, doc: Document, digest: bytes) -> bool:
        if doc.split is not None:
            if doc.split not in SPLITS:
                raise RecipeError(
                    f"{doc.source}: a document's split {str(doc.split)[:40]!r} is none of {', '.join(SPLITS)}"
                )
            return doc.split == "validation"
        if self.patterns:
            held = self._held.get(doc.source)
            if held is None:
                held = self._held[doc.source] = matches(doc.source, self.patterns)
            if held:
                return True
        return int.from_bytes(digest[:8], "big") < self.threshold


def matches(source: str, patterns: list[str]) -> bool:
    """Whether ``source`` or a folder above it matches one of the glob ``patterns``."""
    path = Path(source)
    candidates = [source, path.as_posix(), *(str(p) for p in path.parents if str(p) not in (".", "/"))]
    return any(fnmatch.fnmatchcase(c, pattern) for c in candidates for pattern in patterns)


class _Sources:
    """Per-source counts: documents and text bytes, the given entries filled in."""

    def __init__(self, given: list[dict] | None):
        self.entries = [dict(e, documents=0, text_bytes=0) for e in (given or [])]
        self._owner: dict[str, dict] = {}

    def of(self, name: str) -> dict:
        owner = self._owner.get(name)
        if owner is None:
            owner = next((e for e in self.entries if e["path"] == name or matches_parent(name, e["path"])), None)
            if owner is None and len(self.entries) == 1:
                owner = self.entries[0]
            if owner is None:
                owner = {"path": name, "format": "documents", "bytes": 0, "documents": 0, "text_bytes": 0}
                self.entries.append(owner)
            self._owner[name] = owner
        return owner

    def manifest(self) -> list[dict]:
        return [
            {
                "path": e["path"],
                "format": e["format"],
                "bytes": int(e["bytes"] or e["text_bytes"]),
                "documents": e["documents"],
            }
            for e in self.entries
        ]


def matches_parent(name: str, folder: str) -> bool:
    folder = folder.rstrip("/" + os.sep)
    return name.startswith((folder + "/", folder + os.sep))


def _valid_utf8(text: str) -> tuple[bytes, bool]:
    """The UTF-8 bytes of ``text``; lone surrogates (JSON's ``\\ud800``) become U+FFFD."""
    try:
        return text.encode("utf-8"), False
    except UnicodeEncodeError:
        fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return fixed.encode("utf-8"), True


def cut_units(
    documents: Iterable[Document],
    shard_bytes: int,
    splitter: _Splitter,
    key: bytes,
    sources: _Sources,
    counts: dict,
    tick=lambda: None,
) -> Iterator[Unit]:
    """The stream in units of about ``shard_bytes`` of text, each with its content hash;
    ``tick()`` every few hundred documents (the progress bar)."""
    blobs: list[bytes] = []
    digests: list[bytes] = []
    held: list[bool] = []
    size = 0
    index = 0

    def unit() -> Unit:
        lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
        validation = np.array(held, dtype=bool)
        digest = hashlib.sha256(key)
        digest.update(b"".join(digests))
        digest.update(validation.tobytes())
        return Unit(index, b"".join(blobs), np.cumsum(lengths), validation, digest.hexdigest())

    for doc in documents:
        text = doc.text
        if not isinstance(text, str):
            raise RecipeError(f"{doc.source or 'a document'}: a document's text is {type(text).__name__}, not a string")
        if not text:
            continue
        data, fixed = _valid_utf8(text)
        counts["replaced"] += fixed
        digest = hashlib.sha1(data).digest()
        blobs.append(data)
        digests.append(digest)
        held.append(splitter.held_out(doc, digest))
        owner = sources.of(doc.source)
        owner["documents"] += 1
        owner["text_bytes"] += len(data)
        size += len(data)
        counts["text_bytes"] += len(data)
        if len(blobs) % 256 == 0:
            tick()
        if size >= shard_bytes:
            yield unit()
            blobs, digests, held, size = [], [], [], 0
            index += 1
    if blobs:
        yield unit()


class _Bar:
    """The progress bar on stderr: stored bytes read (or text bytes, for a plain iterable) with
    MB/s, and tokens/s of the units finished."""

    def __init__(self, documents, enabled: bool, counts: dict):
        self.documents, self.counts = documents, counts
        self.total = getattr(documents, "bytes_total", None)
        self.bar = None
        self.started = time.perf_counter()
        self.shown = 0
        if enabled:
            # position 0: another bar left open must not push this one down a line; disable=None:
            # none when stderr is not a terminal (a log would fill with carriage returns)
            self.bar = tqdm(
                total=self.total,
                desc="tokenizing",
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                leave=False,
                position=0,
                file=sys.stderr,
                smoothing=0.1,
                disable=None,
            )

    def update(self) -> None:
        if self.bar is None:
            return
        done = self.documents.bytes_read if self.total is not None else self.counts["text_bytes"]
        if done > self.shown:
            self.bar.update(done - self.shown)
            self.shown = done

    def tokens(self) -> None:
        if self.bar is not None:
            seconds = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{self.counts['tokens'] / seconds / 1e6:.2f}M tokens/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.update()
            self.bar.close()


def _intact(folder: Path, record: dict, dtype: np.dtype, stamps: Stamps) -> bool:
    """Whether a recorded unit's shards are there, at their size and checksum."""
    for entry in record["shards"].values():
        for key, size, digest in (
            (entry["tokens"], entry["n_tokens"] * dtype.itemsize, entry["sha256"]),
            (entry["index"], entry["n_documents"] * 8, entry["index_sha256"]),
        ):
            path = folder / key
            try:
                stat = path.stat()
            except OSError:
                return False
            if stat.st_size != size:
                return False
            if not stamps.known(key, stat, digest):
                if file_sha256(path) != digest:
                    return False
                stamps.add(key, stat, digest)
    return True


def tokenize_documents(
    documents: Iterable[Document],
    tokenizer,
    out: Path,
    *,
    workers: int = 1,
    val_fraction: float = 0.0,
    shard_bytes: int = 64 << 20,
    sources: list[dict] | None = None,
    progress: bool = True,
    val_sources: list[str] | None = None,
    settings: dict | None = None,
    overwrite: bool = False,
    wait: bool = False,
) -> TokenizedDataset:
    """``documents`` tokenized into the dataset folder ``out``, which is returned opened (its
    ``stats``: what this run did). ``sources``: the manifest's source records (``path``,
    ``format``, ``bytes``; documents are counted here); ``val_sources``: globs over document
    sources held out whole; ``settings``: what else determined the documents (the command's
    text field, separator, tokenizer argument), recorded and compared on a rerun; ``overwrite``:
    start over in a folder begun with other settings; ``wait``: a folder another process is writing
    (a cache two runs fill at once) is waited for and its work reused, not refused. See the module
    docstring."""
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise RecipeError(f"val_fraction {val_fraction}: give a fraction in [0, 1)")
    if workers < 1 or shard_bytes < 1:
        raise RecipeError(f"workers {workers}, shard_bytes {shard_bytes}: give at least 1 of each")
    started = time.perf_counter()
    dtype = dtype_for(tokenizer.vocab_size)
    eos = tokenizer.eos_id
    val_sources = list(val_sources or [])
    identity = {
        "tokenizer": tokenizer.fingerprint(),
        "dtype": dtype.name,
        "eos_id": eos,
        "val_fraction": val_fraction,
        "val_sources": val_sources,
        "shard_bytes": shard_bytes,
        "sources": [s["path"] for s in sources or []],
        **(settings or {}),
    }
    folder = Folder(out, identity, overwrite, wait)
    try:
        tokenizer_entry = save_tokenizer(tokenizer, out)
        key = json.dumps({"version": VERSION, **identity}, sort_keys=True).encode()
        counts = collections.Counter(text_bytes=0, tokens=0, replaced=0, reused=0, tokenized=0)
        tracked = _Sources(sources)
        bar = _Bar(documents, progress, counts)
        units = cut_units(
            documents, shard_bytes, _Splitter(val_fraction, val_sources), key, tracked, counts, bar.update
        )
        try:
            results = _run(units, folder, tokenizer, workers, dtype, eos, bar, counts)
        finally:
            bar.close()
        if not results:
            raise RecipeError("no documents to tokenize (every source was empty)")
        manifest = _manifest(
            results, tokenizer, tokenizer_entry, dtype, eos, tracked, val_fraction, val_sources, identity
        )
        payload = dumps(manifest)
        if not (out / MANIFEST).is_file() or (out / MANIFEST).read_bytes() != payload:  # a finished rerun: kept
            write_atomic(out / MANIFEST, payload)
            fsync_folder(out)
        folder.remove_stale(manifest, len(results))
    finally:
        folder.release()
    dataset = TokenizedDataset.open(out)
    seconds = time.perf_counter() - started
    dataset.stats = {
        "seconds": seconds,
        "text_bytes": counts["text_bytes"],
        "units": len(results),
        "reused_units": counts["reused"],
        "tokenized_units": counts["tokenized"],
        "replaced_unicode": counts["replaced"],
        "source_bytes": getattr(documents, "bytes_total", None) or counts["text_bytes"],
        "sources": [dict(e) for e in tracked.entries],
    }
    return dataset


def _run(
    units: Iterator[Unit],
    folder: Folder,
    tokenizer,
    workers: int,
    dtype: np.dtype,
    eos: int | None,
    bar: _Bar,
    counts: collections.Counter,
) -> list[dict]:
    """Every unit reused or tokenized; their records in unit order."""

    out = folder.out
    records = folder.records()
    stamps = Stamps(out)
    results: list[dict] = []
    pool = None
    flight: collections.deque = collections.deque()  # (unit index, its hash, the future of its shards)

    def record(index: int, unit_hash: str, shards: dict) -> None:
        entry = {"unit": index, "hash": unit_hash, "shards": shards}
        write_atomic(folder.record_path(index), dumps(entry))
        for shard in shards.values():  # written by this run: their checksums are known
            for key, digest in ((shard["tokens"], shard["sha256"]), (shard["index"], shard["index_sha256"])):
                with contextlib.suppress(OSError):
                    stamps.add(key, (out / key).stat(), digest)
        results.append(entry)
        counts["tokenized"] += 1
        counts["tokens"] += sum(s["n_tokens"] for s in shards.values())
        bar.tokens()

    def land_oldest() -> None:
        index, unit_hash, future = flight.popleft()
        try:
            shards = future.result()
        except BrokenProcessPool:
            raise RecipeError(
                "a tokenize worker stopped (killed, or out of memory); rerun the same command to resume"
            ) from None
        record(index, unit_hash, shards)

    context = one_thread() if workers == 1 else contextlib.nullcontext()
    try:
        with context:
            for unit in units:
                bar.update()
                old = records.get(unit.index)
                if old is not None and old.get("hash") == unit.hash and _intact(out, old, dtype, stamps):
                    results.append(old)
                    counts["reused"] += 1
                    counts["tokens"] += sum(s["n_tokens"] for s in old["shards"].values())
                    continue
                if old is not None:  # its shards are about to be replaced: the record goes first
                    folder.record_path(unit.index).unlink()
                    records.pop(unit.index)
                with contextlib.suppress(FileNotFoundError):
                    (out / MANIFEST).unlink()  # the dataset is unfinished until this run's manifest
                if workers == 1:
                    record(unit.index, unit.hash, tokenize_unit(unit, tokenizer, out, dtype, eos))
                    continue
                if pool is None:
                    pool = _pool(workers, tokenizer, out, dtype, eos)
                while len(flight) >= IN_FLIGHT * workers:
                    land_oldest()
                flight.append((unit.index, unit.hash, pool.submit(work, unit)))
                del unit
            while flight:
                land_oldest()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        stamps.save()
    results.sort(key=lambda r: r["unit"])
    return results


def _pool(workers: int, tokenizer, out: Path, dtype: np.dtype, eos: int | None):

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["yamlformer.recipes.data.shards", "yamlformer.recipes.data.tokenizers"])
    else:
        context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(
        workers, mp_context=context, initializer=start_worker, initargs=(tokenizer.state(), str(out), dtype.str, eos)
    )


def _manifest(
    results: list[dict],
    tokenizer,
    tokenizer_entry: dict,
    dtype: np.dtype,
    eos: int | None,
    sources: _Sources,
    val_fraction: float,
    val_sources: list[str],
    identity: dict,
) -> dict:
    splits = {}
    for split in SPLITS:
        shards = [r["shards"][split] for r in results if split in r["shards"]]
        splits[split] = {
            "tokens": sum(s["n_tokens"] for s in shards),
            "documents": sum(s["n_documents"] for s in shards),
            "shards": shards,
        }
    settings = {
        k: v
        for k, v in identity.items()
        if k not in ("tokenizer", "dtype", "eos_id", "val_fraction", "val_sources", "sources")
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "eos_id": eos,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer_entry,
        "sources": sources.manifest(),
        "split": {"val_fraction": val_fraction, "val_sources": val_sources, "rule": RULE},
        "settings": settings,
        "splits": splits,
    }
