"""The output folder of ``builder tokenize`` while a run writes it (:mod:`yamlformer.recipes.data.tokenize`):
locked, its settings checked against a run that began it, what a killed run left removed, the
tokenizer's file saved beside the shards. Torch-free."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.data.tokenized import (
    FORMAT,
    MANIFEST,
    SPLITS,
    STARTED,
    TOKENIZER_FILES,
    VERSION,
    is_tokenized_dataset,
)
from yamlformer.recipes.errors import RecipeError

#: per-unit done records
UNITS = ".units"
_SHARD_NAME = re.compile(r"\d{5,}\.(bin|idx)")
#: a temp file beside its target, as ``write_atomic`` names it (``_remove_temp_files`` clears them)
_TEMP = re.compile(r"\..+\.tmp-.+")


class Folder:
    """The output folder while a run writes it: locked, its settings checked, its leftovers removed.
    ``wait``: a folder another process holds is waited for (said on stderr), not refused."""

    def __init__(self, out: Path, settings: dict, overwrite: bool, wait: bool = False):
        self.out, self.settings = out, settings
        self._lock = None
        check_output(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # local: builder.checkpoints loads only to name a failed write
            from yamlformer.builder.checkpoints import write_reason

            raise RecipeError(f"could not make {out}: {write_reason(exc)}") from None
        self._take_lock(wait)
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

        started = dumps({"format": FORMAT, "version": VERSION, "settings": settings})
        if not (out / STARTED).is_file() or (out / STARTED).read_bytes() != started:
            write_atomic(out / STARTED, started)
        (out / UNITS).mkdir(exist_ok=True)
        self._remove_temp_files()

    def _take_lock(self, wait: bool) -> None:
        try:
            # local: POSIX only
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
            if not wait:
                handle.close()
                raise RecipeError(
                    f"{self.out} is being written by another `builder tokenize` ({holder}); wait for it, "
                    "or give another folder"
                ) from None
            # a cache two runs fill at once: the holder's work is reused once it lets go (a killed
            # holder lets go at once: the kernel drops its lock)
            print(f"waiting for {holder}, which is tokenizing into {self.out}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename if hasattr(os, 'uname') else 'this host'}\n")
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        if self._lock is not None:
            self._lock.truncate(0)  # no holder named once it lets go
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
    if out.is_dir() and any(not _ours_in_passing(p.name) for p in out.iterdir()) and not is_tokenized_dataset(out):
        raise RecipeError(
            f"{out}: a folder with other files in it (not a `builder tokenize` output); give a new or empty folder"
        )


def _ours_in_passing(name: str) -> bool:
    """A file a run starting to write the folder holds before it is a tokenize output: the lock, and
    the temp file its first settings are written through (two nodes of one launch, sharing a
    cache, start at once: the second saw them and refused the folder)."""
    return name == ".lock" or _TEMP.fullmatch(name) is not None


def _differences(before: dict, now: dict) -> str:
    keys = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    shown = [f"{k}: {_short(before.get(k))} there, {_short(now.get(k))} now" for k in keys[:3]]
    return "; ".join(shown) + (f"; {len(keys) - 3} more" if len(keys) > 3 else "")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:56] + " ..."


def dumps(value) -> bytes:
    return (json.dumps(value, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def save_tokenizer(tokenizer, out: Path) -> dict:
    """The tokenizer's file in ``out`` (rewritten only when it differs); its manifest entry."""

    state = tokenizer.state()
    name = TOKENIZER_FILES[tokenizer.kind]
    entry = {"kind": tokenizer.kind, "fingerprint": tokenizer.fingerprint(), "file": name}
    if tokenizer.kind == "sentencepiece":
        payload = state["model_proto"]
    elif tokenizer.kind == "tokenizers":
        payload = state["json"].encode("utf-8")
        entry.update(specials=state["specials"], split_special_tokens=state["split_special_tokens"])
    else:
        payload = dumps({"type": "char", "chars": state["chars"]})
    path = out / name
    if not path.is_file() or path.read_bytes() != payload:
        write_atomic(path, payload)
    return entry
