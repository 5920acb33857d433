"""Datasets for the tests without a network: the real files when a local copy exists, small
generated stand-ins (registered with their own checksums) otherwise, and a local HTTP server."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import os
import random
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the data mirror a development checkout may have beside it (the layout of recipes/data/registry.py)
MIRROR = REPO.parent / "shared" / "data"


def real_data_root(*paths: str) -> Path | None:
    """A local folder holding the real files ``paths`` (dataset layout): ``$BUILDER_DATA`` if it
    holds them, else ``../shared/data`` beside the repository; ``None`` when neither does. Tests
    never download: a test that needs the real data skips when this is ``None``."""
    for root in (os.environ.get("BUILDER_DATA"), MIRROR):
        if root and all((Path(root) / p).is_file() for p in paths):
            return Path(root)
    return None


NO_REAL_DATA = (
    "the real {what} is not here and tests never download: set BUILDER_DATA to a folder holding "
    "{paths} (or put the data mirror at ../shared/data beside the repository)"
)


def _words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "en", "dor", "il", "as", "th", "orn", "ew"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def _zipf_lines(rng: random.Random, words: list[str], n_lines: int) -> list[list[str]]:
    weights = [1 / (i + 1) for i in range(len(words))]
    return [rng.choices(words, weights, k=rng.randint(3, 12)) for _ in range(n_lines)]


def stand_in_files(name: str, seed: int = 0) -> dict[str, bytes]:
    """Generated files for dataset ``name`` in its layout: Zipf-distributed made-up words; for
    multi30k a word-for-word "translation" (a fixed dictionary), so a model can learn it."""
    rng = random.Random(seed)
    if name == "tinyshakespeare":
        words = _words(rng, 800)
        lines = []
        for line in _zipf_lines(rng, words, 6000):
            speaker = rng.choice(["KING", "ROMEO", "NURSE", "FIRST CITIZEN"])
            lines.append(f"{speaker}:\n{' '.join(line).capitalize()}.\n")
        return {"tinyshakespeare.txt": "\n".join(lines).encode()}
    if name == "multi30k":
        de_words = _words(rng, 300)
        en_words = _words(random.Random(seed + 1), 300)
        rng.shuffle(en_words)
        to_en = dict(zip(de_words, en_words))
        files = {}
        for split, n in (("train", 3000), ("val", 120), ("test2016", 120)):
            lines = _zipf_lines(rng, de_words, n)
            files[f"multi30k/{split}.de"] = "".join(" ".join(words).capitalize() + ".\n" for words in lines).encode()
            files[f"multi30k/{split}.en"] = "".join(
                " ".join(to_en[w] for w in words).capitalize() + ".\n" for words in lines
            ).encode()
        return files
    raise KeyError(name)


def stand_in(name: str, contents: dict[str, bytes], url_base: str | None = None):
    """The registry's dataset ``name`` with checksums (and, given ``url_base``, URLs) of ``contents``."""
    from yamlformer.recipes.data.registry import DATASETS

    dataset = DATASETS[name]
    files = []
    for remote in dataset.files:
        changes = {}
        if remote.path in contents:
            data = contents[remote.path]
            changes.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        if url_base is not None:
            changes["url"] = served_url(url_base, remote)
        files.append(dataclasses.replace(remote, **changes))
    return dataclasses.replace(dataset, files=tuple(files))


def served_url(url_base: str, remote) -> str:
    return f"{url_base}/{remote.path}" + (".gz" if remote.gzipped else "")


def write_files(root: Path, contents: dict[str, bytes]) -> Path:
    for path, data in contents.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def data_for_recipes(root: Path, monkeypatch, real: bool = True) -> dict[str, str]:
    """Make every downloadable dataset readable offline under ``root`` (BUILDER_DATA is set to it):
    the real files copied when a local copy exists (and ``real``), else stand-ins registered in their place; the
    registry's URLs are made unreachable, so nothing can be fetched. Only the training and
    validation splits are written (a test split, if any, is missing).
    Returns ``{dataset: "real" | "stand-in"}``."""
    from yamlformer.recipes.data import registry as datasets

    kinds = {}
    for name, dataset in datasets.DATASETS.items():
        if not dataset.files:
            continue
        needed = [
            path for split in (dataset.train, dataset.validation) if split for path in dataset.splits[split].values()
        ]
        local = real_data_root(*needed) if real else None
        if local is not None:
            contents, kinds[name] = {p: (local / p).read_bytes() for p in needed}, "real"
            checksums = {}  # the registry's own
        else:
            checksums = stand_in_files(name)
            contents, kinds[name] = {p: checksums[p] for p in needed}, "stand-in"
        write_files(root, contents)
        # every URL unreachable (the discard port): a run that tried to download would fail
        monkeypatch.setitem(datasets.DATASETS, name, stand_in(name, checksums, "http://127.0.0.1:9"))
    monkeypatch.setenv("BUILDER_DATA", str(root))
    return kinds


class Server:
    """A local HTTP server: ``routes`` maps a path to ``(behaviour, bytes)``; behaviours: ``ok``,
    ``drop`` (promise the length, send a third, close), ``stall`` (say nothing until stopped),
    ``nolength`` (no Content-Length, close at the end). Every request's path is in ``hits``."""

    def __init__(self):
        self.routes: dict[str, tuple[str, bytes]] = {}
        self.hits: list[str] = []
        self.stop = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits.append(self.path)
                behaviour, body = outer.routes.get(self.path, ("missing", b""))
                if behaviour == "missing":
                    self.send_error(404)
                    return
                if behaviour == "stall":
                    outer.stop.wait(30)
                    return
                self.send_response(200)
                if behaviour != "nolength":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 3] if behaviour == "drop" else body)
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def serve(self, remote, data: bytes, behaviour: str = "ok") -> None:
        """Serve ``data`` (gzipped when the registry's file is) at ``remote``'s local URL."""
        body = gzip.compress(data, mtime=0) if remote.gzipped else data
        self.routes[served_url("", remote)] = (behaviour, body)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def keyword_examples(folder: Path, train: int, validation: int, seed: int = 0) -> None:
    """``folder/train.csv`` (``train`` rows) and ``folder/val.jsonl`` (``validation`` rows) of
    labelled text: the label is whether the text mentions "apple" (half do)."""
    import csv
    import json

    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "cat",
        "dog",
        "runs",
        "sits",
        "blue",
        "green",
        "house",
        "tree",
        "river",
        "stone",
        "bread",
        "milk",
        "over",
        "under",
        "quick",
        "slow",
    ]
    rows = []
    for i in range(train + validation):
        text = [rng.choice(words) for _ in range(rng.randint(4, 10))]
        if i % 2:
            text.insert(rng.randrange(len(text) + 1), "apple")
        rows.append({"text": " ".join(text), "label": "fruit" if i % 2 else "none"})
    with open(folder / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(rows[:train])
    (folder / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows[train:]) + "\n", encoding="utf-8")
