"""``builder tokenize``'s pipeline: a stream of documents into a tokenized dataset (the format of
:mod:`recipes.data.tokenized`), in bounded memory, in parallel, resumable. Torch-free.

The stream is cut, in order, into *units* of about ``shard_bytes`` of UTF-8 text (a cut falls
after the document that reaches it), whatever the number of workers; unit ``k`` becomes the shard
``k`` of each split it has documents of. Workers (processes of the ``forkserver`` context where
there is one, else ``spawn``; each builds the tokenizer once from its ``state()`` and encodes on
one thread) tokenize a unit and write its shards themselves (a temp file, fsync, rename), handing
back only their sizes and checksums. The main process reads and splits the stream, keeps at most
two units per worker in flight and records results in unit order, so its memory is a few units,
never the corpus, and every byte written (shards and manifest) is the same for any worker count.
One worker runs in this process.

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
import dataclasses
import fnmatch
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from recipes.data.sources import Document
from recipes.data.tokenized import (
    FORMAT,
    MANIFEST,
    SPLITS,
    STARTED,
    TOKENIZER_FILES,
    VERSION,
    Stamps,
    TokenizedDataset,
    dtype_for,
    file_sha256,
    is_tokenized_dataset,
)
from recipes.errors import RecipeError

#: per-unit done records
UNITS = ".units"
#: text handed to one encode_batch call: enough to amortize the call, small enough that the
#: library's per-token objects (tokenizers keeps strings and offsets per token) stay a few MB
BATCH_CHARS = 1 << 20
#: a longer document is encoded in pieces cut at a line break between two non-space characters
#: (no tokenizer shipped here joins across one), so no single call holds a huge document's tokens
LONG_DOCUMENT_CHARS = 8 << 20
#: units in flight per worker
IN_FLIGHT = 2
RULE = (
    "sha1(UTF-8 text)[:8] as a big-endian integer / 2**64 < val_fraction goes to validation; documents of "
    "val_sources (the path or a folder above it matching a glob) and documents given a split keep theirs"
)
_SHARD_NAME = re.compile(r"\d{5,}\.(bin|idx)")
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclasses.dataclass
class Unit:
    """A run of documents: their UTF-8 text end to end, each one's end offset and split."""

    index: int
    blob: bytes
    ends: np.ndarray  # int64 byte end offsets
    validation: np.ndarray  # bool per document
    hash: str

    @property
    def n_documents(self) -> int:
        return len(self.ends)


def shard_names(split: str, index: int) -> tuple[str, str]:
    return f"{split}/{index:05d}.bin", f"{split}/{index:05d}.idx"


# -- the worker side -----------------------------------------------------------------------------


def encode(tokenizer, texts: list[str], dtype: np.dtype, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``texts`` as one array of ids (each followed by ``eos``) and each one's end offset."""
    parts: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []
    size = 0

    def flush() -> None:
        ids = _encode_batch(tokenizer, batch)
        if eos is not None:
            for one in ids:
                one.append(eos)
        counts = [len(one) for one in ids]
        lengths.extend(counts)
        try:
            parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(counts)))
        except (OverflowError, ValueError):
            top = max(max(one, default=0) for one in ids)
            raise RecipeError(
                f"token id {top} does not fit the dataset's {dtype.name} (the tokenizer's vocabulary "
                f"says {tokenizer.vocab_size:,} ids)"
            ) from None
        batch.clear()

    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            flush()
            size = 0
    if batch:
        flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return tokens, np.cumsum(np.asarray(lengths, dtype=np.int64), dtype=np.int64)


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if all(len(t) <= LONG_DOCUMENT_CHARS for t in texts):
        return tokenizer.encode_batch(texts)
    out = []
    for text in texts:
        if len(text) <= LONG_DOCUMENT_CHARS:
            out.extend(tokenizer.encode_batch([text]))
            continue
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(tokenizer.encode_batch([piece])[0])
        out.append(ids)
    return out


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of about LONG_DOCUMENT_CHARS, cut after a newline between non-space characters."""
    start = 0
    while len(text) - start > LONG_DOCUMENT_CHARS:
        match = _CUT.search(text, start + LONG_DOCUMENT_CHARS)
        if match is None:
            break
        yield text[start : match.start()]
        start = match.start()
    yield text[start:]


def write_file(path: Path, array: np.ndarray) -> str:
    """``array``'s bytes to ``path`` (:func:`recipes.data.tokenizers.write_atomic`: temp file, fsync,
    rename); their sha256."""
    from recipes.data.tokenizers import write_atomic

    data = memoryview(np.ascontiguousarray(array)).cast("B")
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def tokenize_unit(unit: Unit, tokenizer, out: Path, dtype: np.dtype, eos: int | None) -> dict:
    """Unit ``unit`` tokenized into its shards under ``out``; each split's shard record."""
    ends_at = unit.ends.tolist()
    starts = [0, *ends_at[:-1]]
    shards = {}
    for split, mask in (("train", ~unit.validation), ("validation", unit.validation)):
        chosen = np.flatnonzero(mask)
        if not len(chosen):
            continue
        blob = unit.blob
        texts = [blob[starts[i] : ends_at[i]].decode("utf-8") for i in chosen.tolist()]
        tokens, ends = encode(tokenizer, texts, dtype, eos)
        del texts
        bin_name, idx_name = shard_names(split, unit.index)
        (out / split).mkdir(exist_ok=True)
        shards[split] = {
            "tokens": bin_name,
            "index": idx_name,
            "n_tokens": len(tokens),
            "n_documents": len(ends),
            "sha256": write_file(out / bin_name, tokens),
            "index_sha256": write_file(out / idx_name, ends.astype("<i8")),
        }
    for split in shards:
        _fsync_folder(out / split)
    return shards


_WORKER: dict = {}


def _start_worker(state: dict, out: str, dtype: str, eos: int | None) -> None:
    """A worker's start: one thread for its tokenizer (W workers use W cores), built once. Ctrl+C
    is the main process's to handle (it lets the units in flight finish and stops)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from recipes.data.tokenizers import from_state

    _WORKER.update(tokenizer=from_state(state), out=Path(out), dtype=np.dtype(dtype), eos=eos)


def _work(unit: Unit) -> dict:
    w = _WORKER
    return tokenize_unit(unit, w["tokenizer"], w["out"], w["dtype"], w["eos"])


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _one_thread():
    """This process's encode_batch calls on one thread while the block runs."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# -- the folder ------------------------------------------------------------------------------------


class Folder:
    """The output folder while a run writes it: locked, its settings checked, its leftovers removed."""

    def __init__(self, out: Path, settings: dict, overwrite: bool):
        self.out, self.settings = out, settings
        self._lock = None
        check_output(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from builder.checkpoints import write_reason

            raise RecipeError(f"could not make {out}: {write_reason(exc)}") from None
        self._take_lock()
        started = self._started()
        if started is not None and started != settings:
            if not overwrite:
                raise RecipeError(
                    f"{out} holds a tokenize run with other settings ({_differences(started, settings)});"
                    " rerun with its settings, or add --overwrite to start over"
                )
            self.clear()
        elif started is None and (out / MANIFEST).is_file():  # a dataset another version wrote
            if not overwrite:
                raise RecipeError(f"{out} holds a dataset without its run's settings; add --overwrite to start over")
            self.clear()
        from recipes.data.tokenizers import write_atomic

        started = _dumps({"format": FORMAT, "version": VERSION, "settings": settings})
        if not (out / STARTED).is_file() or (out / STARTED).read_bytes() != started:
            write_atomic(out / STARTED, started)
        (out / UNITS).mkdir(exist_ok=True)
        self._remove_temp_files()

    def _take_lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # no flock here (Windows): one run per folder is up to the user
            return
        path = self.out / ".lock"
        handle = open(path, "a+")  # noqa: SIM115  (held until release)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RecipeError(
                f"{self.out} is being written by another `builder tokenize` ({holder}); wait for it, "
                "or give another folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename if hasattr(os, 'uname') else 'this host'}\n")
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _started(self) -> dict | None:
        try:
            return json.loads((self.out / STARTED).read_text(encoding="utf-8"))["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clear(self) -> None:
        """Remove what a tokenize run writes (nothing else)."""
        for name in (MANIFEST, STARTED, *TOKENIZER_FILES.values()):
            with contextlib.suppress(FileNotFoundError):
                (self.out / name).unlink()
        for name in (UNITS, *SPLITS):
            shutil.rmtree(self.out / name, ignore_errors=True)
        for stamp in self.out.glob(".verified-*.json"):
            stamp.unlink()

    def _remove_temp_files(self) -> None:
        for folder in (self.out, self.out / UNITS, *(self.out / s for s in SPLITS)):
            if folder.is_dir():
                for tmp in folder.glob(".*.tmp-*"):
                    with contextlib.suppress(OSError):
                        tmp.unlink()

    def records(self) -> dict[int, dict]:
        """The done records of earlier runs, by unit."""
        found = {}
        for path in (self.out / UNITS).glob("*.json"):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
                found[int(record["unit"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                with contextlib.suppress(OSError):
                    path.unlink()  # torn or foreign: never trusted
        return found

    def record_path(self, index: int) -> Path:
        return self.out / UNITS / f"{index:05d}.json"

    def remove_stale(self, manifest: dict, units: int) -> None:
        """Shards and records no longer part of the dataset (a rerun over a shorter corpus)."""
        listed = {e[key] for s in SPLITS for e in manifest["splits"][s]["shards"] for key in ("tokens", "index")}
        for split in SPLITS:
            folder = self.out / split
            if folder.is_dir():
                for path in folder.iterdir():
                    if _SHARD_NAME.fullmatch(path.name) and f"{split}/{path.name}" not in listed:
                        path.unlink()
        for path in (self.out / UNITS).glob("*.json"):
            if path.stem.isdigit() and int(path.stem) >= units:
                path.unlink()


def check_output(out: Path) -> None:
    """Refuse an output that is a file, or a folder holding anything but a tokenize run's files."""
    if out.exists() and not out.is_dir():
        raise RecipeError(f"{out}: is a file; give a folder for the dataset")
    if out.is_dir() and any(p.name != ".lock" for p in out.iterdir()) and not is_tokenized_dataset(out):
        raise RecipeError(
            f"{out}: a folder with other files in it (not a `builder tokenize` output); give a new or empty folder"
        )


def _differences(before: dict, now: dict) -> str:
    keys = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    shown = [f"{k}: {_short(before.get(k))} there, {_short(now.get(k))} now" for k in keys[:3]]
    return "; ".join(shown) + (f"; {len(keys) - 3} more" if len(keys) > 3 else "")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:56] + " ..."


def _dumps(value) -> bytes:
    return (json.dumps(value, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def save_tokenizer(tokenizer, out: Path) -> dict:
    """The tokenizer's file in ``out`` (rewritten only when it differs); its manifest entry."""
    from recipes.data.tokenizers import write_atomic

    state = tokenizer.state()
    name = TOKENIZER_FILES[tokenizer.kind]
    entry = {"kind": tokenizer.kind, "fingerprint": tokenizer.fingerprint(), "file": name}
    if tokenizer.kind == "sentencepiece":
        payload = state["model_proto"]
    elif tokenizer.kind == "tokenizers":
        payload = state["json"].encode("utf-8")
        entry.update(specials=state["specials"], split_special_tokens=state["split_special_tokens"])
    else:
        payload = _dumps({"type": "char", "chars": state["chars"]})
    path = out / name
    if not path.is_file() or path.read_bytes() != payload:
        write_atomic(path, payload)
    return entry


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
            from tqdm.auto import tqdm

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
) -> TokenizedDataset:
    """``documents`` tokenized into the dataset folder ``out``, which is returned opened (its
    ``stats``: what this run did). ``sources``: the manifest's source records (``path``,
    ``format``, ``bytes``; documents are counted here); ``val_sources``: globs over document
    sources held out whole; ``settings``: what else determined the documents (the command's
    text field, separator, tokenizer argument), recorded and compared on a rerun; ``overwrite``:
    start over in a folder begun with other settings. See the module docstring."""
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
    folder = Folder(out, identity, overwrite)
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
        from recipes.data.tokenizers import write_atomic

        payload = _dumps(manifest)
        if not (out / MANIFEST).is_file() or (out / MANIFEST).read_bytes() != payload:  # a finished rerun: kept
            write_atomic(out / MANIFEST, payload)
            _fsync_folder(out)
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
    from recipes.data.tokenizers import write_atomic

    out = folder.out
    records = folder.records()
    stamps = Stamps(out)
    results: list[dict] = []
    pool = None
    flight: collections.deque = collections.deque()  # (unit index, its hash, the future of its shards)

    def record(index: int, unit_hash: str, shards: dict) -> None:
        entry = {"unit": index, "hash": unit_hash, "shards": shards}
        write_atomic(folder.record_path(index), _dumps(entry))
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

    from concurrent.futures.process import BrokenProcessPool

    context = _one_thread() if workers == 1 else contextlib.nullcontext()
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
                flight.append((unit.index, unit.hash, pool.submit(_work, unit)))
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
    from concurrent.futures import ProcessPoolExecutor

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["recipes.data.tokenize", "recipes.data.tokenizers"])
    else:
        context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer.state(), str(out), dtype.str, eos)
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
