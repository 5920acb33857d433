"""Datasets made on this machine rather than downloaded: ``python-signatures``, instruction records
about the Python standard library's functions, and ``python-signature-pairs``, preference pairs made
from the same signatures; each written once per interpreter under the data root.

Each public function a module of :data:`MODULES` defines in Python gives two records: its
signature (``Write the signature of json.dumps.`` -> ``def dumps(obj, *, skipkeys=False, ...):``)
and what its docstring's first line says it does. A language model trained on the standard
library's source (``recipes/lm-stdlib.yaml``) has read each definition; the records ask for what
it has seen in another shape, which is what instruction tuning teaches. The records are the same
for the same Python version; records longer than :data:`MAX_CHARS` are left out.

A pair (``task: preference``) asks for a function's signature: the chosen answer is its own, the
rejected one the same signature under the name of the function after it in the same module, so
the two differ in the name alone and a model prefers the right one by naming the function it was
asked about.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

from yamlformer.recipes.data.files import write_atomic

#: modules whose functions the records are about: pure-Python, importable everywhere, no side effects
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "fnmatch", "fractions", "functools", "genericpath", "gettext", "glob", "gzip", "heapq", "html",
    "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "mimetypes", "ntpath", "posixpath", "pprint",
    "quopri", "random", "secrets", "shlex", "shutil", "statistics", "string", "tempfile", "textwrap", "tokenize",
    "traceback", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip
#: the longest record kept (prompt and answer, characters): short enough for a small model's rows
MAX_CHARS = 160
VERSION = 2  # bump when the records change
PAIRS_VERSION = 3  # bump when the pairs change


def signature_records() -> list[dict]:
    """The records, in a fixed order (module doc)."""
    records = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module this interpreter lacks
            continue
        for attr, function in sorted(vars(module).items()):
            if attr.startswith("_") or not inspect.isfunction(function) or function.__module__ != name:
                continue
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                continue
            qualified = f"{name}.{attr}"
            records.append({"prompt": f"Write the signature of {qualified}.", "response": f"def {attr}{signature}:"})
            doc = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
            if doc:
                records.append({"prompt": f"What does {qualified} do?", "response": doc})
    return [r for r in records if len(r["prompt"]) + len(r["response"]) <= MAX_CHARS]


def _written(root: Path, name: str, version: int, records) -> list[Path]:
    """``records()`` for this interpreter as the JSON Lines file of dataset ``name`` (its
    ``version``) under the data root ``root``, written when absent."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = root / name / f"python{python}-v{version}.jsonl"
    if not path.is_file():
        lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records())
        write_atomic(path, lines.encode("utf-8"))
    return [path]


def python_signatures(root: Path) -> list[Path]:
    """The records for this interpreter as a JSON Lines file under the data root ``root``,
    written when absent."""
    return _written(root, "python-signatures", VERSION, signature_records)


def signature_pairs() -> list[dict]:
    """The pairs, in a fixed order (module doc): each signature record against itself under the
    name of the next function of its module (the module's last: its first)."""
    asked = [r for r in signature_records() if r["prompt"].startswith("Write the signature of ")]
    modules: dict[str, list[dict]] = {}
    for record in asked:
        modules.setdefault(record["prompt"].rsplit(".", 2)[0], []).append(record)
    pairs = []
    for records in modules.values():
        for i, record in enumerate(records):
            name = record["prompt"].removesuffix(".").rsplit(".", 1)[1]
            other = records[(i + 1) % len(records)]["prompt"].removesuffix(".").rsplit(".", 1)[1]
            if other != name:
                rejected = "def " + other + record["response"].removeprefix("def " + name)
                pairs.append({"prompt": record["prompt"], "chosen": record["response"], "rejected": rejected})
    return pairs


def python_signature_pairs(root: Path) -> list[Path]:
    """The pairs for this interpreter as a JSON Lines file under the data root ``root``, written
    when absent."""
    return _written(root, "python-signature-pairs", PAIRS_VERSION, signature_pairs)
