"""Corpus files read as a stream of documents, for ``builder tokenize``: plain text, JSON Lines,
Parquet, Arrow IPC and Hugging Face ``datasets`` folders saved with ``save_to_disk``, and folders
of any of these (recursive, sorted). Torch-free; pyarrow is imported only for Parquet and Arrow.

Nothing holds a whole file: text is decoded in chunks and cut at ``separator`` (without one, a
file is one document), JSON Lines are read line by line, Parquet one row group at a time (the
text column only), Arrow IPC batch by batch; files are read, not memory-mapped (a mapped file's
pages would count in the process's memory as it is read). Every problem is one
:class:`RecipeError` line naming the file and the line, row or byte, never quoting the file's
contents.

What a file is, by its name: ``.parquet`` Parquet; ``.arrow`` / ``.feather`` Arrow IPC (file or
stream format); ``.jsonl``, ``.json``, ``.ndjson`` JSON Lines, also compressed (``.gz``, ``.zst``;
a bare ``.zst`` is JSON Lines); anything else plain text (also ``.gz`` / ``.zst``-compressed). A
folder with ``state.json`` and ``dataset_info.json`` (a ``Dataset``) or ``dataset_dict.json`` (a
``DatasetDict``) is a ``save_to_disk`` folder; a ``DatasetDict``'s ``train`` split is forced to
train, its ``validation`` (``valid``, ``val``, ``dev``) split to validation, other splits (``test``)
are left out. Hidden files and folders, and ``builder tokenize`` outputs, are skipped.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from yamlformer.builder.outputs import shown
from yamlformer.builder.paths import path_problem
from yamlformer.recipes.data.walk import Seen, walk
from yamlformer.recipes.errors import RecipeError

#: bytes read from a file at a time
CHUNK = 1 << 20
#: rows converted to Python strings at a time from Parquet and Arrow
BATCH_ROWS = 4096
#: the source formats a manifest names
FORMATS = ("text", "jsonl", "parquet", "arrow", "hf-disk")
#: compressions read, by suffix; the refused ones are named so the message can say so
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
UNSUPPORTED = (".bz2", ".xz", ".lz4", ".lzma", ".zip", ".7z", ".tar", ".tgz", ".rar")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
#: DatasetDict split names and the split their documents are forced to (others are left out)
HF_SPLITS = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
}


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its text, the split it must go to (None: the split rule decides) and the
    source it came from (a file's path as the user would write it)."""

    text: str
    split: str | None = None
    source: str = ""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: Path  # to open
    name: str  # as the user would write it: the given path, or the given folder joined with the file
    format: str  # text | jsonl | parquet | arrow
    compression: str | None = None  # gzip | zstd
    split: str | None = None  # a DatasetDict split's forced split
    bytes: int = 0


@dataclasses.dataclass
class Source:
    """One SOURCE argument: a file or a folder, the files it holds in reading order."""

    path: str  # as given
    format: str  # text | jsonl | parquet | arrow | hf-disk; a folder of several kinds: "jsonl,text"
    files: list[SourceFile]
    skipped: list[str] = dataclasses.field(default_factory=list)  # DatasetDict splits left out

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def entry(self) -> dict:
        """The manifest's record of this source (``documents`` is counted as it is read)."""
        return {"path": self.path, "format": self.format, "bytes": self.bytes, "documents": 0}


def file_format(path: Path) -> tuple[str, str | None]:
    """``(format, compression)`` of a corpus file by its name (see the module docstring)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet", None
    if name.endswith((".arrow", ".feather")):
        return "arrow", None
    for suffix in UNSUPPORTED:
        if name.endswith(suffix):
            raise RecipeError(
                f"{path}: a {suffix} file, which builder tokenize does not read; decompress it, or "
                "compress it with gzip (.gz) or zstd (.zst)"
            )
    compression = next((c for s, c in COMPRESSIONS.items() if name.endswith(s)), None)
    inner = name.rsplit(".", 1)[0] if compression else name
    if inner.endswith(JSONL_SUFFIXES) or (compression == "zstd" and "." not in inner):
        return "jsonl", compression
    return "text", compression


def is_hf_disk(folder: Path) -> bool:
    """Whether ``folder`` is a ``datasets`` ``save_to_disk`` folder (a Dataset or a DatasetDict)."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def find_sources(paths: list[str], exclude: Path | None = None) -> list[Source]:
    """Each SOURCE with its files (folders walked recursively in sorted order, links followed,
    each real file once over all the sources: :mod:`yamlformer.recipes.data.walk`); ``exclude``:
    a folder never read (the output). A missing path, a device or FIFO, an empty folder or a
    refused compression is a :class:`RecipeError`."""
    # local: the tokenized format (numpy) loads only when a folder is looked into
    from yamlformer.recipes.data.tokenized import is_tokenized_dataset

    skip = exclude.resolve() if exclude is not None else None
    seen = Seen()
    sources = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise RecipeError(f"{shown(given)}: no such file or folder")
        if not (path.is_file() or path.is_dir()):
            raise RecipeError(
                f"{shown(given)}: not a regular file or folder (a device, FIFO or socket); give corpus files or folders"
            )
        if path.is_dir() and is_tokenized_dataset(path):
            raise RecipeError(f"{shown(given)}: a tokenized dataset (a `builder tokenize` output), not a corpus")
        read_already = seen.known(path)
        if path.is_dir() and is_hf_disk(path):
            files, skipped = _hf_files(path, given) if seen.first(path) else ([], [])
            sources.append(Source(given, "hf-disk", _read_once(files, given), skipped))
            continue
        if path.is_file():
            files = [_file(path, given)] if seen.first(path) else []
        else:
            files = []
            walked = walk(
                path,
                seen,
                hidden=False,
                skip=lambda d: (skip is not None and d.resolve() == skip) or is_tokenized_dataset(d),
                whole=is_hf_disk,  # a save_to_disk folder inside
            )
            for sub in walked:
                name = os.path.join(given, sub.relative_to(path))
                files += _hf_files(sub, name)[0] if sub.is_dir() else [_file(sub, name)]
            if not files and not read_already:
                raise RecipeError(f"{shown(given)}: a folder with no files to read")
        sources.append(Source(given, ",".join(sorted({f.format for f in files})), _read_once(files, given)))
    return sources


def _read_once(files: list[SourceFile], given: str) -> list[SourceFile]:
    """``files``, unless there are none because another source holds them all (a path given
    twice, a folder and a file in it): read once, through the first."""
    if not files:
        raise RecipeError(
            f"{shown(given)}: every file in it is read already through an earlier source (a path given twice?)"
        )
    return files


def _file(path: Path, name: str) -> SourceFile:
    fmt, compression = file_format(path)
    return SourceFile(path, name, fmt, compression, bytes=path.stat().st_size)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecipeError(f"{path}: not a readable datasets file ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: not a datasets file (a JSON object)")
    return data


def _hf_files(folder: Path, given: str) -> tuple[list[SourceFile], list[str]]:
    """The Arrow files of a save_to_disk folder in their order (``state.json``), with a
    DatasetDict's splits; the splits left out."""
    if (folder / "dataset_dict.json").is_file():
        splits = _read_json(folder / "dataset_dict.json").get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise RecipeError(f"{folder / 'dataset_dict.json'}: no list of splits")
        files, skipped = [], []
        for split in splits:
            if split not in HF_SPLITS:
                skipped.append(split)
                continue
            for f in _hf_files(folder / split, os.path.join(given, split))[0]:
                files.append(dataclasses.replace(f, split=HF_SPLITS[split]))
        if not files:
            raise RecipeError(
                f"{given}: a DatasetDict with no train or validation split (its splits: {', '.join(splits)})"
            )
        return files, skipped
    state = _read_json(folder / "state.json")
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries
    ):
        raise RecipeError(f"{folder / 'state.json'}: no _data_files list")
    files = []
    for entry in entries:
        path = folder / entry["filename"]
        if Path(entry["filename"]).is_absolute() or ".." in Path(entry["filename"]).parts or not path.is_file():
            raise RecipeError(
                f"{folder / 'state.json'}: lists {entry['filename'][:80]!r}, which is not a file of the folder"
            )
        files.append(SourceFile(path, os.path.join(given, entry["filename"]), "arrow", bytes=path.stat().st_size))
    return files, []


class DocumentStream:
    """Every document of ``sources``, in order: an iterable of :class:`Document`.

    ``bytes_read`` is how much of the files (as stored) has been read, against ``bytes_total``:
    what a progress bar shows. ``documents`` counts each source's documents read. A source that
    yields no document is an error at its end, naming it.
    """

    def __init__(self, sources: list[Source], text_field: str = "text", separator: str | None = None):
        if separator == "":
            raise RecipeError("the separator is empty; give a string that ends a document, or none")
        self.sources, self.text_field, self.separator = sources, text_field, separator
        self.bytes_total = sum(s.bytes for s in sources)
        self.bytes_read = 0
        self.documents: dict[str, int] = {}

    def __iter__(self) -> Iterator[Document]:
        self.bytes_read = 0
        for source in self.sources:
            count = 0
            for file in source.files:
                done = self.bytes_read
                for text in self._texts(file):
                    if text:
                        count += 1
                        yield Document(text, file.split, file.name)
                self.bytes_read = done + file.bytes
            self.documents[source.path] = count
            if count == 0:
                files = f"{len(source.files)} file{'s' * (len(source.files) != 1)}"
                raise RecipeError(f"{source.path}: no documents ({files}, {source.bytes:,} bytes, read)")

    def _texts(self, file: SourceFile) -> Iterator[str]:
        if file.format == "text":
            return self._text(file)
        if file.format == "jsonl":
            return self._jsonl(file)
        if file.format == "parquet":
            return self._parquet(file)
        return self._arrow(file)

    # -- plain text ------------------------------------------------------------------------------

    def _text(self, file: SourceFile) -> Iterator[str]:
        """The file's text cut at the separator (none: the whole file), decoded as it is read."""
        sep = self.separator
        decoder = codecs.getincrementaldecoder("utf-8")()
        pending: list[str] = []  # text since the last separator
        tail = ""  # the end of the pending text, where a separator may begin
        fed = 0  # bytes given to the decoder
        start = self.bytes_read
        with _open(file) as f:
            while True:
                chunk = f.read(CHUNK)
                held = len(decoder.getstate()[0])
                try:
                    text = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as exc:
                    where = fed - held + exc.start
                    of = " of the decompressed text" if file.compression else ""
                    raise RecipeError(
                        f"{file.name}: not UTF-8 text (byte {where:,}{of}); builder tokenize reads text as UTF-8"
                    ) from None
                fed += len(chunk)
                self.bytes_read = start + min(_raw_position(f, fed), file.bytes)
                if sep is not None and sep in tail + text:
                    parts = "".join([*pending, text]).split(sep)
                    yield from parts[:-1]
                    pending, tail = [parts[-1]], parts[-1][-(len(sep) - 1) :] if len(sep) > 1 else ""
                elif text:
                    pending.append(text)
                    if sep is not None and len(sep) > 1:
                        tail = (tail + text)[-(len(sep) - 1) :]
                if not chunk:
                    break
        yield "".join(pending)

    # -- JSON Lines -------------------------------------------------------------------------------

    def _jsonl(self, file: SourceFile) -> Iterator[str]:
        field = self.text_field
        start = self.bytes_read
        with _open(file) as f:
            for number, line in enumerate(f, 1):
                if number % 1024 == 0:
                    self.bytes_read = start + min(_raw_position(f, None), file.bytes)
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise RecipeError(f"{file.name}:{number}: not UTF-8 (byte {exc.start:,} of the line)") from None
                except json.JSONDecodeError as exc:
                    hint = (
                        " (a .json file is read as JSON Lines: one object a line)"
                        if number == 1 and file.path.name.lower().endswith((".json", ".json.gz", ".json.zst"))
                        else ""
                    )
                    raise RecipeError(
                        f"{file.name}:{number}: not JSON ({exc.msg} at column {exc.colno}){hint}"
                    ) from None
                if not isinstance(value, dict):
                    raise RecipeError(
                        f"{file.name}:{number}: a JSON {_json_kind(value)}, not an object with a {field!r} field"
                    )
                if field not in value:
                    raise RecipeError(
                        f"{file.name}:{number}: no field {field!r} (its fields: {_names(value)}); "
                        "--text-field names the field that holds the text"
                    )
                text = value[field]
                if not isinstance(text, str):
                    raise RecipeError(
                        f"{file.name}:{number}: field {field!r} is a JSON {_json_kind(text)}, not a string"
                    )
                yield text

    # -- Parquet and Arrow ------------------------------------------------------------------------

    def _parquet(self, file: SourceFile) -> Iterator[str]:
        """Row group by row group (pyarrow's batch iterator buffers ahead: a file's worth, for a
        file of many groups), the text column only."""
        # local: pyarrow loads only for a Parquet or Arrow file
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(file.path)
            schema = parquet.schema_arrow
        except (pa.ArrowException, OSError) as exc:
            raise RecipeError(f"{file.name}: not a readable Parquet file ({_arrow_reason(exc)})") from None
        column = self._column(file, schema)
        total = max(1, parquet.metadata.num_rows)
        start, row = self.bytes_read, 0
        for group in range(parquet.num_row_groups):
            try:
                table = parquet.read_row_group(group, columns=[column], use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                raise RecipeError(
                    f"{file.name}: row group {group} (rows from {row:,}) cannot be read: a damaged "
                    f"Parquet file ({_arrow_reason(exc)})"
                ) from None
            texts = table.column(0)
            for offset in range(0, len(texts), BATCH_ROWS):
                yield from self._strings(file, texts.slice(offset, BATCH_ROWS), row + offset)
            row += len(texts)
            del table, texts
            self.bytes_read = start + file.bytes * row // total

    def _arrow(self, file: SourceFile) -> Iterator[str]:
        # local: pyarrow loads only for a Parquet or Arrow file
        import pyarrow as pa

        try:
            # read, not mapped: a mapped file's pages would count in the process's memory as it is read
            stored = pa.OSFile(str(file.path))
            try:
                reader = pa.ipc.open_file(stored)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: the stream format (save_to_disk writes that)
                stored.seek(0)
                reader = pa.ipc.open_stream(stored)
                batches = iter(reader)
            schema = reader.schema
        except (pa.ArrowException, OSError) as exc:
            raise RecipeError(f"{file.name}: not a readable Arrow IPC file ({_arrow_reason(exc)})") from None
        column = schema.get_field_index(self._column(file, schema))
        start, row, read = self.bytes_read, 0, 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as exc:
                raise RecipeError(
                    f"{file.name}: rows from {row:,} cannot be read: a damaged Arrow file ({_arrow_reason(exc)})"
                ) from None
            for offset in range(0, batch.num_rows, BATCH_ROWS):
                part = batch.slice(offset, BATCH_ROWS)
                yield from self._strings(file, part.column(column), row + offset)
            row += batch.num_rows
            read += batch.nbytes  # about what the batch takes in the file
            self.bytes_read = start + min(read, file.bytes)

    def _column(self, file: SourceFile, schema) -> str:
        """The text column's name, checked: present and of a string type."""
        # local: pyarrow loads only for a Parquet or Arrow file
        import pyarrow as pa

        field = self.text_field
        if field not in schema.names:
            names = ", ".join(n[:40] for n in schema.names[:20]) + (" ..." if len(schema.names) > 20 else "")
            raise RecipeError(
                f"{file.name}: no column {field!r} (its columns: {names or 'none'}); --text-field "
                "names the column that holds the text"
            )
        kind = schema.field(field).type
        if not (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)
        ):
            raise RecipeError(f"{file.name}: column {field!r} holds {kind}, not strings")
        return field

    def _strings(self, file: SourceFile, column, first_row: int) -> list[str]:
        if column.null_count:
            # local: pyarrow loads only for a Parquet or Arrow file
            import pyarrow.compute as pc

            row = first_row + pc.index(column.is_null(), True).as_py()
            raise RecipeError(f"{file.name}: row {row:,}: column {self.text_field!r} is null, not a string")
        return column.to_pylist()


def _open(file: SourceFile) -> BinaryIO:
    """The file's bytes, decompressed; a damaged archive is a RecipeError when read, and so is a
    path that is no readable regular file (a FIFO would block the open: asked before it)."""
    why = path_problem(file.path)
    if why is not None:
        raise RecipeError(f"{shown(file.name)}: {why}")
    raw = open(file.path, "rb")  # noqa: SIM115  (closed by the wrapper)
    if file.compression == "gzip":
        # local: a decompressor loads only for a compressed file
        import gzip

        return _Guarded(gzip.GzipFile(fileobj=raw, mode="rb"), raw, file)
    if file.compression == "zstd":
        # local: a decompressor loads only for a compressed file
        import io

        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return _Guarded(io.BufferedReader(reader, buffer_size=CHUNK), raw, file, (zstandard.ZstdError,))
    return _Guarded(raw, raw, file)


class _Guarded:
    """A binary file whose read errors (a damaged .gz or .zst) become one RecipeError line."""

    def __init__(self, inner, raw, file: SourceFile, errors: tuple = ()):
        self.inner, self.raw, self.file = inner, raw, file
        self.errors = (OSError, EOFError, ValueError, *errors)

    def _damaged(self, exc: Exception) -> RecipeError:
        what = f"damaged {self.file.compression} file" if self.file.compression else "file that cannot be read"
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        return RecipeError(f"{self.file.name}: cannot be read: a {what} ({reason})")

    def read(self, n: int = -1) -> bytes:
        try:
            return self.inner.read(n)
        except self.errors as exc:
            raise self._damaged(exc) from None

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                line = self.inner.readline()
            except self.errors as exc:
                raise self._damaged(exc) from None
            if not line:
                return
            yield line

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()
        self.raw.close()


def _raw_position(f: _Guarded, fed: int | None) -> int:
    """How far into the stored (compressed) file ``f`` has read."""
    try:
        return f.raw.tell()
    except (OSError, ValueError):
        return fed or 0


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _names(value: dict) -> str:
    names = [repr(k[:40]) for k in list(value)[:10]]
    return ", ".join(names) + (" ..." if len(value) > 10 else "") if names else "none"


def _arrow_reason(exc: Exception) -> str:
    """pyarrow's message, first line, cut (it never quotes row data, but may be long)."""
    text = " ".join(str(exc).strip().splitlines()[:1]).strip()
    return (text[:120] + " ...") if len(text) > 120 else (text or type(exc).__name__)
