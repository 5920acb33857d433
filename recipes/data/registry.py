"""Datasets by name: where each comes from, its checksums and terms, and how it splits. Torch-free.

A recipe names a dataset (``data: {dataset: tinyshakespeare}``) instead of a path. A dataset's
files live under one *data root*, always in the same layout (``tinyshakespeare.txt``,
``multi30k/train.de`` ...). The root is, first that is set:

- ``data.root`` in the recipe (relative to the recipe file);
- the ``BUILDER_DATA`` environment variable;
- the user cache, ``platformdirs.user_cache_dir("builder")/data``: ``~/.cache/builder/data`` on
  Linux, ``~/Library/Caches/builder/data`` on macOS, ``%LOCALAPPDATA%\\builder\\Cache\\data`` on
  Windows.

A file found under the root is checked against its sha256 and used as it is, so a folder that
already holds the files (an offline copy) is all a machine without a network needs: nothing is
fetched. A missing file is downloaded there: into a temporary file beside it, verified (gzip's
own check, then the sha256 of what is stored), then renamed, so an interrupted download never
leaves a file that looks complete. Downloads time out (``BUILDER_DATA_TIMEOUT`` seconds without
data, default 30) instead of hanging. Every failure is one :class:`DatasetError` line that names
the URL and where to put a copy instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import hashlib
import http.client
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from yamlformer.recipes.data.generated import python_signature_pairs, python_signatures
from yamlformer.recipes.data.walk import walk
from yamlformer.recipes.errors import RecipeError

#: the environment variable naming the data root (a folder of dataset files, or where to download them)
ENV_ROOT = "BUILDER_DATA"
#: the environment variable setting the download timeout: seconds without data before giving up
ENV_TIMEOUT = "BUILDER_DATA_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
#: downloads at least this large show a progress bar
PROGRESS_BYTES = 1 << 20
_CHUNK = 1 << 16


class DatasetError(RecipeError):
    """A dataset that cannot be found, fetched or verified; the message is one line."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: where it is stored under the data root and where it comes from."""

    path: str  # under the data root, "/"-separated: "multi30k/train.de"
    url: str
    sha256: str  # of the file as stored
    size: int  # bytes as stored
    gzipped: bool = False  # the URL serves it gzip-compressed; it is stored unpacked
    download_sha256: str | None = None  # of the bytes served, when known (else gzip's CRC checks them)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset by name. ``splits`` maps a split name to its files by key (a language for
    parallel text, ``text`` for a corpus); a corpus without a held-out split is split by
    ``val_fraction`` (its last share held out)."""

    name: str
    description: str
    license: str
    how_to_split: str
    splits: Mapping[str, Mapping[str, str]]
    files: tuple[RemoteFile, ...] = ()
    train: str = "train"
    validation: str | None = None
    test: str | None = None
    val_fraction: float | None = None
    restricted: bool = False  # terms that limit use: printed before every first download
    local: Callable[[], list[Path]] | None = None  # files of this machine instead of downloads

    @property
    def keys(self) -> list[str]:
        """The file keys of a split: the languages of a parallel dataset."""
        return list(self.splits[self.train])

    def file(self, path: str) -> RemoteFile:
        return next(f for f in self.files if f.path == path)

    def split_of(self, role: str) -> str:
        """The split that plays ``role`` (train, validation or test)."""
        split = getattr(self, role)
        if split is None:
            raise DatasetError(f"dataset {self.name!r} has no {role} split (its splits: {', '.join(self.splits)})")
        return split


# -- the registry ------------------------------------------------------------------------------------

#: folders of the standard library left out of `python-stdlib` (installed packages, test suites)
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in walk(root, skip=lambda d: d.name in _STDLIB_SKIP) if f.suffix == ".py"]


_CHAR_RNN = "https://raw.githubusercontent.com/karpathy/char-rnn/6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e"
_MULTI30K = "https://raw.githubusercontent.com/multi30k/dataset/a3d2e0d26b56f3846f66a952536ffed4e401d05a"

#: Multi30k task 1, raw (cased, untokenized) text: (split, upstream file stem, language) -> (sha256, bytes)
_MULTI30K_FILES = {
    ("train", "train", "de"): ("2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72", 2110398),
    ("train", "train", "en"): ("460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6", 1801238),
    ("val", "val", "de"): ("660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660", 75981),
    ("val", "val", "en"): ("1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227", 63297),
    ("test2016", "test_2016_flickr", "de"): ("4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16", 70649),
    ("test2016", "test_2016_flickr", "en"): ("399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182", 62076),
}


def _generated(name: str, what: str, write) -> Dataset:
    """A dataset of records made from the running interpreter (``yamlformer.recipes.data.generated``):
    ``what`` they are, ``write(root)`` their files under the data root."""
    return Dataset(
        name=name,
        description=f"{what}; made from the running interpreter (yamlformer.recipes.data.generated)",
        license="the Python Software Foundation License (made from the interpreter's own modules; nothing is "
        "downloaded)",
        how_to_split="records; the recipe's data.val_fraction of them held out",
        splits={},
        local=lambda: write(default_root()),
    )


DATASETS: dict[str, Dataset] = {
    "tinyshakespeare": Dataset(
        name="tinyshakespeare",
        description="Tiny Shakespeare: 1.1 MB of Shakespeare's plays, the corpus of char-rnn and nanoGPT",
        license="public-domain text, from karpathy/char-rnn (MIT)",
        how_to_split="one file; the last 10% held out for validation (nanoGPT's shakespeare_char split)",
        splits={"train": {"text": "tinyshakespeare.txt"}},
        files=(
            RemoteFile(
                "tinyshakespeare.txt",
                f"{_CHAR_RNN}/data/tinyshakespeare/input.txt",
                "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
                1115394,
            ),
        ),
        val_fraction=0.1,
    ),
    "multi30k": Dataset(
        name="multi30k",
        description="Multi30k task 1: 31,014 English image captions with German translations "
        "(Elliott et al. 2016, doi:10.18653/v1/W16-3210)",
        license="no license file; derived from Flickr30K and provided solely for non-commercial research "
        "and educational use (github.com/multi30k/dataset, 'Use of the data')",
        how_to_split="train 29,000 / val 1,014 / test2016 1,000 line-aligned pairs (files de and en); "
        "tune and validate on val, report test2016",
        splits={
            split: {lang: f"multi30k/{split}.{lang}" for lang in ("de", "en")} for split in ("train", "val", "test2016")
        },
        files=tuple(
            RemoteFile(
                f"multi30k/{split}.{lang}", f"{_MULTI30K}/data/task1/raw/{stem}.{lang}.gz", sha, size, gzipped=True
            )
            for (split, stem, lang), (sha, size) in _MULTI30K_FILES.items()
        ),
        validation="val",
        test="test2016",
        restricted=True,
    ),
    "python-stdlib": Dataset(
        name="python-stdlib",
        description="the Python standard library's own .py source, read from the running interpreter "
        "(its tests and installed packages left out)",
        license="the Python Software Foundation License (the interpreter's own files; nothing is downloaded)",
        how_to_split="a corpus; the recipe's data.val_fraction of its tokens (the tail) held out",
        splits={},
        local=_stdlib_files,
    ),
    "python-signatures": _generated(
        "python-signatures",
        "instruction records about the standard library's functions (their signatures and what their docstrings say)",
        python_signatures,
    ),
    "python-signature-pairs": _generated(
        "python-signature-pairs",
        "preference pairs (task: preference) asking for a standard-library function's signature: its own chosen, "
        "its module's next function's rejected",
        python_signature_pairs,
    ),
}


def names() -> list[str]:
    return list(DATASETS)


def get(name: str) -> Dataset:
    """The dataset called ``name``; an unknown name gets the closest known one."""
    if name in DATASETS:
        return DATASETS[name]
    close = difflib.get_close_matches(name, DATASETS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise DatasetError(f"unknown dataset {name!r}; {hint}known: {', '.join(DATASETS)} (or give file paths)")


# -- where the files are -----------------------------------------------------------------------------


def default_root() -> Path:
    """``$BUILDER_DATA``, else the user cache's ``data`` folder."""
    env = os.environ.get(ENV_ROOT)
    if env:
        return Path(env).expanduser()
    # local: platformdirs loads only where no $BUILDER_DATA is set
    import platformdirs

    return Path(platformdirs.user_cache_dir("builder", appauthor=False)) / "data"


def data_root(root: str | Path | None = None) -> Path:
    """The folder dataset files are read from and downloaded to: ``root`` (a recipe's ``data.root``,
    already resolved) when given, else :func:`default_root`."""
    return Path(root).expanduser() if root is not None else default_root()


def timeout_seconds() -> float:
    value = os.environ.get(ENV_TIMEOUT)
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise DatasetError(f"{ENV_TIMEOUT}={value!r}: give seconds, a number > 0")
    return seconds


def split_files(
    name: str, split: str | None = None, root: str | Path | None = None, timeout: float | None = None
) -> dict[str, Path]:
    """The files of one split (default: the training split) by key, fetched and verified."""
    dataset = get(name)
    split = split or dataset.train
    if split not in dataset.splits:
        known = ", ".join(dataset.splits) or "none: it is read from this machine"
        raise DatasetError(f"dataset {name!r} has no split {split!r} (its splits: {known})")
    base = data_root(root)
    return {key: ensure(dataset, dataset.file(path), base, timeout) for key, path in dataset.splits[split].items()}


def text_files(name: str, root: str | Path | None = None) -> list[Path]:
    """A dataset read as a text corpus: its training split's files (or its local files)."""
    dataset = get(name)
    if dataset.local is not None:
        return dataset.local()
    return list(split_files(name, dataset.train, root).values())


_VERIFIED: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The sha256 of a file, remembered while its size and modification time stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        _VERIFIED[key] = digest.hexdigest()
    return _VERIFIED[key]


def _instead(remote: RemoteFile, base: Path) -> str:
    return (
        f"to use a copy instead, put it at {base / remote.path} or point {ENV_ROOT} (or data.root) "
        f"at a folder holding {remote.path}"
    )


def ensure(dataset: Dataset, remote: RemoteFile, base: Path, timeout: float | None = None) -> Path:
    """``remote``'s file under ``base``: verified if there, else downloaded there first."""
    path = base.joinpath(*remote.path.split("/"))
    if path.is_file():
        got = file_sha256(path)
        if got != remote.sha256:
            raise DatasetError(
                f"{path} has sha256 {got[:16]}..., not {dataset.name}'s {remote.sha256[:16]}... (from {remote.url}); "
                f"delete it to download it again, or point {ENV_ROOT} (or data.root) at a folder with the right file"
            )
        return path
    if path.exists():
        raise DatasetError(f"{path} is not a file; move it away, or point {ENV_ROOT} (or data.root) elsewhere")
    download(dataset, remote, path, timeout if timeout is not None else timeout_seconds(), base)
    return path


_NOTICED: set[str] = set()


def _notice(dataset: Dataset, remote: RemoteFile, path: Path) -> None:
    if dataset.name not in _NOTICED:
        _NOTICED.add(dataset.name)
        terms = "TERMS OF USE" if dataset.restricted else "license"
        print(f"{dataset.name}: {dataset.description}; {terms}: {dataset.license}", file=sys.stderr, flush=True)
    print(f"downloading {remote.url} -> {path}", file=sys.stderr, flush=True)


def download(dataset: Dataset, remote: RemoteFile, path: Path, timeout: float, base: Path | None = None) -> None:
    """Fetch ``remote`` to ``path`` atomically: a temporary file beside it is filled, unpacked,
    verified and renamed; on any failure (or interruption) the temporaries are removed."""
    _notice(dataset, remote, path)
    instead = _instead(remote, base if base is not None else path.parent)
    made = [d for d in reversed(path.parents) if not d.exists()]
    temps: list[Path] = []
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".download")
        except OSError as exc:
            raise DatasetError(f"cannot write {path} ({exc.strerror or exc}); {instead}") from None
        temps.append(Path(name))
        with os.fdopen(fd, "wb") as out:
            served = _fetch(remote.url, out, timeout, remote.size, instead)
        if remote.download_sha256 is not None and served != remote.download_sha256:
            raise DatasetError(
                f"{remote.url} served bytes with sha256 {served[:16]}..., not the expected "
                f"{remote.download_sha256[:16]}...; nothing was kept; {instead}"
            )
        stored = temps[0]
        if remote.gzipped:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".unpacked")
            temps.append(Path(name))
            with os.fdopen(fd, "wb") as out:
                _gunzip(temps[0], out, remote.url, instead)
            stored = temps[1]
        got = file_sha256(stored)
        if got != remote.sha256:
            raise DatasetError(
                f"{remote.url} gave a file with sha256 {got[:16]}..., not the expected "
                f"{remote.sha256[:16]}...; nothing was kept; {instead}"
            )
        os.replace(stored, path)
        temps.remove(stored)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
        for folder in reversed(made):  # only folders this download made, and only if still empty
            try:
                folder.rmdir()
            except OSError:
                break


def _fetch(url: str, out, timeout: float, expected_size: int, instead: str) -> str:
    """Stream ``url`` into ``out``; returns the sha256 of the bytes served."""
    # local: the progress bar loads only for work long enough to show one
    from tqdm.auto import tqdm

    digest, got, total = hashlib.sha256(), 0, None
    request = urllib.request.Request(url, headers={"User-Agent": "yamlformer"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            big = (total or expected_size) >= PROGRESS_BYTES
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=url.rsplit("/", 1)[-1],
                disable=not big,
                leave=False,
                file=sys.stderr,
            ) as bar:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as exc:
        raise DatasetError(f"downloading {url} failed: HTTP {exc.code} {exc.reason}; {instead}") from None
    except urllib.error.URLError as exc:
        raise DatasetError(f"downloading {url} failed: {_reason(exc.reason, timeout)}; {instead}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise DatasetError(
            f"downloading {url} failed: {_reason(exc, timeout)} after {got:,} bytes; {instead}"
        ) from None
    if total is not None and got < total:
        raise DatasetError(
            f"downloading {url} failed: the connection closed after {got:,} of {total:,} bytes; {instead}"
        )
    return digest.hexdigest()


def _reason(exc, timeout: float) -> str:
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no data for {timeout:g} s (timed out; {ENV_TIMEOUT} sets the limit)"
    if isinstance(exc, http.client.IncompleteRead):
        return "the connection closed mid-file"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _gunzip(source: Path, out, url: str, instead: str) -> None:
    try:
        with gzip.open(source, "rb") as f:
            shutil.copyfileobj(f, out, _CHUNK)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{url} is not a whole gzip file ({exc}); nothing was kept; {instead}") from None
