"""How fast ``builder`` starts: the same commands timed from outside, whole process, on two
versions of the project side by side in one run (default: ``main`` against this working tree).

Each version is laid out as installed (``yamlformer/{builder,blocks,kernels,recipes}`` and the
zoo's specs, copied from ``git archive REF`` or from the working tree) with its own entry points
(read from that version's ``pyproject.toml``: the commands and the document kinds differ between
versions), and run as the ``builder`` command runs, ``yamlformer.builder.cli:main``, in a fresh
Python whose path starts there. The runs alternate (A B A B ...) so a machine's drift hits both;
the medians, their spread and the median of the pair-by-pair ratios are printed.

    python benchmarks/startup.py                       # main vs the working tree, 15 runs each
    python benchmarks/startup.py --base HEAD~1 --runs 30
    python benchmarks/startup.py --json

The commands: ``builder --help`` and ``builder validate specs/tiny/llama.yaml`` (the two whose
start the project keeps fast), ``builder validate lm-stdlib``, ``builder describe specs/tiny/llama.yaml``
(torch-free) and ``builder train lm-stdlib --help``.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("builder", "blocks", "kernels", "recipes")
COMMANDS = {
    "builder --help": ["--help"],
    "builder validate specs/tiny/llama.yaml": ["validate", str(REPO / "specs" / "tiny" / "llama.yaml")],
    "builder validate lm-stdlib": ["validate", "lm-stdlib"],
    "builder describe specs/tiny/llama.yaml": ["describe", str(REPO / "specs" / "tiny" / "llama.yaml")],
    "builder train lm-stdlib --help": ["train", "lm-stdlib", "--help"],
}
RUN = (
    "import sys; sys.path.insert(0, sys.argv[1]); from yamlformer.builder.cli import main; sys.exit(main(sys.argv[2:]))"
)


def lay_out(source: Path, target: Path) -> Path:
    """``source`` (a checkout's files) as an installed yamlformer under ``target``: the four
    folders under the import root, the specs where the zoo finds them, and a ``.dist-info`` with
    that version's entry points (first on the path, so it is the one found)."""
    root = target / "yamlformer"
    for folder in FOLDERS:
        shutil.copytree(source / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(source / "specs", root / "specs")
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    info = target / f"yamlformer-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: yamlformer\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return target


def from_git(ref: str, target: Path) -> Path:
    """The files of ``ref`` laid out (:func:`lay_out`)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, *FOLDERS, "specs", "pyproject.toml"], capture_output=True, check=True
    ).stdout
    source = target / "source"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    return lay_out(source, target / "installed")


def once(tree: Path, args: list[str]) -> float:
    """Wall seconds of one ``builder ARGS`` run of the version at ``tree`` (from a folder of its own)."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(tree), *args], cwd=tree, capture_output=True, text=True, timeout=300
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"builder {' '.join(args)} failed in {tree}:\n{done.stderr[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git ref to compare with (default: main)")
    parser.add_argument("--head", default=None, help="a git ref instead of the working tree")
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each command and version (default 15)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        tmp = Path(tmp)
        base = from_git(args.base, tmp / "base")
        head = from_git(args.head, tmp / "head") if args.head else lay_out(REPO, tmp / "head")
        rows = {}
        for name, command in COMMANDS.items():
            once(base, command), once(head, command)  # a warm-up each: the file cache, .pyc files written
            a, b = [], []
            for _ in range(args.runs):
                a.append(once(head, command))
                b.append(once(base, command))
            ratios = [x / y for x, y in zip(a, b)]
            rows[name] = {
                "head_median_s": statistics.median(a),
                "base_median_s": statistics.median(b),
                "head_range_s": [min(a), max(a)],
                "base_range_s": [min(b), max(b)],
                "ratio_median": statistics.median(ratios),
            }
    if args.json:
        print(json.dumps({"base": args.base, "head": args.head or "working tree", "runs": args.runs, "rows": rows}))
        return 0
    print(f"{args.head or 'working tree'} against {args.base}, {args.runs} alternating runs each, wall seconds")
    print(f"{'command':<42} {'head':>8} {'base':>8} {'head/base':>10}  (min..max head | base)")
    for name, row in rows.items():
        print(
            f"{name:<42} {row['head_median_s']:>8.3f} {row['base_median_s']:>8.3f} {row['ratio_median']:>10.3f}"
            f"  ({row['head_range_s'][0]:.3f}..{row['head_range_s'][1]:.3f} | "
            f"{row['base_range_s'][0]:.3f}..{row['base_range_s'][1]:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
