"""The tokenized-dataset format (``builder tokenize``'s output, described in README.md here) and
its reader. Torch-free.

A dataset is a folder: ``manifest.json`` (written last, atomically), the tokenizer it was made
with, and per split (``train``, ``validation``) shards ``NNNNN.bin`` (token ids, little-endian
``dtype``, each document followed by ``eos_id`` when there is one) with their ``NNNNN.idx``
(little-endian int64 document end offsets: document i is ``tokens[ends[i-1]:ends[i]]``).

:meth:`TokenizedDataset.open` trusts nothing it has not checked: every shard's size against the
manifest at each open, and its sha256 the first time this machine opens it. What was verified is
kept in ``.verified-HOST.json`` (size, mtime, inode and sha256 per file, written atomically;
skipped on a read-only folder), so a later open stats the files and reads no bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from yamlformer.recipes.errors import RecipeError

FORMAT = "builder-tokenized"
VERSION = 1
MANIFEST = "manifest.json"
#: the settings of a tokenize run, written at its start: a folder with it and no manifest is unfinished
STARTED = ".tokenize.json"
SPLITS = ("train", "validation")
#: the tokenizer's file in the folder, by kind
TOKENIZER_FILES = {"sentencepiece": "tokenizer.model", "tokenizers": "tokenizer.json", "char": "tokenizer-char.json"}
#: read at a time when checking a shard's sha256
_READ = 8 << 20
#: verifying more than this shows a progress bar
_BAR_BYTES = 1 << 30


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 ids while the vocabulary fits in 16 bits, else uint32 (little-endian)."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


@dataclasses.dataclass
class Shard:
    """One ``.bin``/``.idx`` pair: ``tokens`` (read-only memory map, the manifest's dtype) and
    ``ends`` (int64 document end offsets, read-only), ``path`` the ``.bin``."""

    tokens: np.ndarray
    ends: np.ndarray
    path: Path

    @property
    def n_documents(self) -> int:
        return len(self.ends)

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s ids (its EOS included)."""
        start = int(self.ends[i - 1]) if i else 0
        return self.tokens[start : int(self.ends[i])]


def is_tokenized_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder holding a builder manifest, or an unfinished ``builder tokenize``."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / STARTED).is_file():
        return True
    try:
        with open(path / MANIFEST, "rb") as f:
            return json.loads(f.read(1 << 20)).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class TokenizedDataset:
    """A finished tokenized dataset, checked (see the module docstring)."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = folder, manifest
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.eos_id: int | None = manifest["eos_id"]
        self.vocab_size: int = manifest["vocab_size"]
        self.stats: dict | None = None  # what tokenize_documents did, when it made this dataset
        self._shards: dict[str, list[Shard]] = {}

    @classmethod
    def open(cls, folder: Path, tokenizer_fingerprint: str | None = None) -> TokenizedDataset:
        """The dataset in ``folder``, its shards checked; a problem is one RecipeError line naming the file."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        theirs = manifest["tokenizer"]["fingerprint"]
        if tokenizer_fingerprint is not None and tokenizer_fingerprint != theirs:
            raise RecipeError(
                f"{folder} was tokenized with tokenizer {theirs}, this run's is {tokenizer_fingerprint}; "
                "tokenize it again with this tokenizer, or use the dataset's (its "
                f"{manifest['tokenizer']['file']})"
            )
        dataset = cls(folder, manifest)
        dataset._check()
        return dataset

    def shards(self, split: str) -> list[Shard]:
        if split not in SPLITS:
            raise RecipeError(f"split {split!r}: a tokenized dataset has the splits {', '.join(SPLITS)}")
        if split not in self._shards:
            self._shards[split] = [self._shard(entry) for entry in self.manifest["splits"][split]["shards"]]
        return self._shards[split]

    def tokens(self, split: str) -> int:
        return int(self._split(split)["tokens"])

    def documents(self, split: str) -> int:
        return int(self._split(split)["documents"])

    def tokenizer(self):
        """The tokenizer saved in the folder, checked against the manifest's fingerprint."""
        # local: the tokenizer libraries load when a dataset's tokenizer is read (a check opens manifests only)
        from yamlformer.recipes.data.tokenizers import CharTokenizer, HFTokenizer, SentencePieceTokenizer

        entry = self.manifest["tokenizer"]
        path = self.folder / entry["file"]
        try:
            if entry["kind"] == "sentencepiece":
                tokenizer = SentencePieceTokenizer(path.read_bytes())
            elif entry["kind"] == "tokenizers":
                tokenizer = HFTokenizer(
                    path.read_text(encoding="utf-8"),
                    entry.get("specials"),
                    bool(entry.get("split_special_tokens", False)),
                )
            elif entry["kind"] == "char":
                tokenizer = CharTokenizer(list(json.loads(path.read_text(encoding="utf-8"))["chars"]))
            else:
                raise RecipeError(
                    f"{self.folder / MANIFEST}: tokenizer kind {str(entry['kind'])[:40]!r} is none of "
                    f"{', '.join(TOKENIZER_FILES)}"
                )
        except RecipeError:
            raise
        except Exception as exc:
            raise RecipeError(f"{path}: the dataset's tokenizer cannot be loaded ({type(exc).__name__})") from None
        if tokenizer.fingerprint() != entry["fingerprint"]:
            raise RecipeError(
                f"{path}: tokenizer {tokenizer.fingerprint()}, but the manifest says the dataset was "
                f"tokenized with {entry['fingerprint']} (the file was changed)"
            )
        return tokenizer

    def _split(self, split: str) -> dict:
        if split not in SPLITS:
            raise RecipeError(f"split {split!r}: a tokenized dataset has the splits {', '.join(SPLITS)}")
        return self.manifest["splits"][split]

    def _shard(self, entry: dict) -> Shard:
        path, index = self.folder / entry["tokens"], self.folder / entry["index"]
        if entry["n_tokens"]:
            tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(entry["n_tokens"],))
        else:  # a shard of documents that tokenized to nothing: no bytes to map
            tokens = np.zeros(0, dtype=self.dtype)
            tokens.setflags(write=False)
        ends = np.memmap(index, dtype="<i8", mode="r", shape=(entry["n_documents"],))
        return Shard(tokens, ends, path)

    def _check(self) -> None:
        """Every shard present at its size; its sha256 verified unless this machine's stamp says
        it already was (the stamp is written at the end)."""
        stamps = Stamps(self.folder)
        todo = []
        for split in SPLITS:
            for entry in self.manifest["splits"][split]["shards"]:
                for key, size, digest in (
                    (entry["tokens"], entry["n_tokens"] * self.dtype.itemsize, entry["sha256"]),
                    (entry["index"], entry["n_documents"] * 8, entry["index_sha256"]),
                ):
                    path = self.folder / key
                    stat = _stat(path, size)
                    if not stamps.known(key, stat, digest):
                        todo.append((key, path, stat, digest))
        total = sum(stat.st_size for _, _, stat, _ in todo)
        bar = None
        if total > _BAR_BYTES:
            # local: the progress bar loads only for work long enough to show one
            from tqdm.auto import tqdm

            bar = tqdm(
                total=total,
                desc=f"verifying {self.folder.name} (first open here)",
                unit="B",
                unit_scale=True,
                leave=False,
                file=sys.stderr,
            )
        try:
            for key, path, stat, digest in todo:
                found = file_sha256(path, bar)
                if found != digest:
                    raise RecipeError(
                        f"{path}: sha256 {found[:16]}..., the manifest says {digest[:16]}... (the file is "
                        "damaged); tokenize the corpus again (rerunning the same `builder tokenize` "
                        "command rebuilds only the damaged shards)"
                    )
                stamps.add(key, stat, digest)
        finally:
            if bar is not None:
                bar.close()
        if todo:
            stamps.save()


def read_manifest(folder: Path) -> dict:
    """``folder``'s manifest, its format, version and fields checked."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise RecipeError(f"{folder}: no such folder (a `builder tokenize` output was expected)")
    if not path.is_file():
        if (folder / STARTED).is_file():
            raise RecipeError(f"{folder} was not finished: rerun the same `builder tokenize` command to resume")
        raise RecipeError(f"{folder}: no {MANIFEST}; not a `builder tokenize` output")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RecipeError(f"{path}: not a readable manifest ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise RecipeError(f"{path}: format {str(found)[:40]!r}, not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise RecipeError(
            f"{path}: version {str(manifest.get('version'))[:20]}; this builder reads version {VERSION} "
            "(a newer builder wrote it?)"
        )
    try:
        if manifest["dtype"] not in ("uint16", "uint32"):
            raise ValueError("dtype")
        for split in SPLITS:
            for entry in manifest["splits"][split]["shards"]:
                for key in ("tokens", "index"):
                    if Path(entry[key]).is_absolute() or ".." in Path(entry[key]).parts:
                        raise ValueError(key)
                int(entry["n_tokens"]), int(entry["n_documents"]), str(entry["sha256"]), str(entry["index_sha256"])
        manifest["tokenizer"]["fingerprint"], manifest["tokenizer"]["file"], manifest["vocab_size"]
        manifest["eos_id"]
    except (KeyError, TypeError, ValueError) as exc:
        raise RecipeError(f"{path}: not a complete {FORMAT} manifest (at {exc})") from None
    return manifest


def _stat(path: Path, size: int) -> os.stat_result:
    try:
        stat = path.stat()
    except OSError:
        raise RecipeError(f"{path}: missing (the manifest lists it); tokenize the corpus again") from None
    if stat.st_size != size:
        raise RecipeError(
            f"{path}: {stat.st_size:,} bytes, the manifest says {size:,} (truncated or damaged); "
            "tokenize the corpus again (rerunning the same `builder tokenize` command rebuilds only "
            "the damaged shards)"
        )
    return stat


def file_sha256(path: Path, bar=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


class Stamps:
    """What this machine verified in a dataset folder: per file (its path in the folder) the size,
    mtime, inode and sha256 it had. A file whose stat still matches is not read again."""

    def __init__(self, folder: Path):
        host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:64] or "host"
        self.path = folder / f".verified-{host}.json"
        try:
            self.files: dict = json.loads(self.path.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            self.files = {}
        self.changed = False

    @staticmethod
    def _key(stat: os.stat_result, digest: str) -> list:
        return [stat.st_size, stat.st_mtime_ns, stat.st_ino, digest]

    def known(self, name: str, stat: os.stat_result, digest: str) -> bool:
        return self.files.get(name) == self._key(stat, digest)

    def add(self, name: str, stat: os.stat_result, digest: str) -> None:
        self.files[name] = self._key(stat, digest)
        self.changed = True

    def keep(self, names: Iterable[str]) -> None:
        """Forget every file but ``names``."""
        names = set(names)
        for name in [n for n in self.files if n not in names]:
            del self.files[name]
            self.changed = True

    def save(self) -> None:
        """Written atomically; a folder this process cannot write is left as it is."""
        if not self.changed:
            return
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"files": self.files}, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
        self.changed = False
