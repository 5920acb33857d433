"""The GPU check: the one script that proves on a GPU what the CPU suite cannot.

    python benchmarks/gpu_check.py                      # every section (about 9 minutes on one H200)
    python benchmarks/gpu_check.py --only fsdp,compile  # some of them
    python benchmarks/gpu_check.py --cpu                # each section's plumbing on the CPU, tiny sizes

Each section runs in a process of its own under a time limit (a hang or a crash costs only its
row), and its table is printed the moment it ends (``benchmarks/gpu_sections.py`` has them):

* ``recipes``: every shipped recipe a few steps as ``builder train`` runs it, ``precision: auto``;
  the seconds to its first step (data, compilation, autotuning) and tokens/s;
* ``fsdp``: FSDP2 in bf16 on one GPU at the first GPU run's shape (0.38B, seq 2048, batch 8):
  tokens/s, MFU, and ``builder describe``'s memory estimate against ``max_memory_allocated``;
* ``compile``: a windowed model (our Triton attention op under ``auto``) eager and with
  ``trainer.compile: true`` (the op's fake implementation against Inductor);
* ``yardstick``: ``builder train`` against ``benchmarks/yardstick.py``'s plain-PyTorch loop at
  GPT-2 small shapes, both compiled and in bf16, and the recipe's host syncs per step;
* ``attention``: ``benchmarks/attention.py --sweep``: every attention kernel against SDPA's flash
  and cuDNN backends, training and decode, and its autotuning seconds;
* ``perf-kernels``: ``benchmarks/perf_kernels.py``: the performance model's GEMM and attention
  efficiencies at the published runs' shapes;
* ``memory``: ``benchmarks/memory.py --adapters``: the training-memory estimate against
  ``max_memory_allocated`` for a frozen 4-layer Llama-2-7B base with LoRA and with QLoRA (NF4).

Without CUDA (and without ``--cpu``) it exits 2. It exits 1 when a section failed. The last line
is JSON (``--json PATH`` writes it to a file too). ``--out DIR`` keeps the tables this GPU measured:
``<gpu>.yaml`` (the calibration table, copied over ``builder/analysis/calibration/`` to ship it)
and ``attention_tuning.yaml`` (merged with the shipped one; copied over ``kernels/`` to ship it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:  # its sibling modules, also under PYTHONSAFEPATH (python -P)
    sys.path.insert(0, str(REPO / "benchmarks"))

#: the sections in the order they run, with the seconds each may take on one H200
#: (gpu_sections.SECTIONS holds the same names with their functions)
ORDER = ("recipes", "fsdp", "compile", "yardstick", "attention", "perf-kernels", "memory")
#: on the CPU everything is tiny but slow to start: each section may take this long
CPU_LIMIT = 240.0
#: seconds a section's process gets beyond its limit to report (its own children time out first)
GRACE = 30.0


def wait_or_kill(child: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``child`` (started in a session of its own) up to ``timeout`` seconds, past which its
    whole process group is killed; whether it was."""
    import signal

    try:
        child.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return True


def run_section(name: str, cpu: bool, limit: float, folder: Path, out: Path | None = None) -> dict:
    """``gpu_check.py --section NAME`` in a child process, killed after ``limit`` seconds; ``out``:
    where the sections that measure a table of this GPU write it."""
    folder.mkdir(parents=True)
    result = folder / "section.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--section", name, str(result), str(limit)]
    command += ["--cpu"] if cpu else []
    command += ["--out", str(out)] if out else []
    # on the CPU, plumbing only: torch.compile runs the code eagerly (Inductor's C++ builds would
    # take minutes; tests/test_kernel_layouts.py compiles through our op on the CPU)
    env = dict(os.environ, **({"TORCH_COMPILE_DISABLE": "1"} if cpu else {}))
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=folder, env=env, start_new_session=True)
    timed_out = wait_or_kill(child, limit + GRACE)  # the section divides `limit` among its own children
    seconds = time.perf_counter() - started
    if result.is_file():
        return {**json.loads(result.read_text()), "seconds": seconds}
    error = f"timed out after {limit + GRACE:.0f} s" if timed_out else f"exit status {child.returncode}, no result"
    return {"rows": [], "ok": False, "error": error, "seconds": seconds}


def section_main(name: str, result: Path, limit: float, cpu: bool, tables: Path | None) -> int:
    """In the section's own process: run it, write its result."""
    from gpu_sections import SECTIONS  # benchmarks/gpu_sections.py

    function, _ = SECTIONS[name]
    try:
        out = function(cpu, result.parent, limit, tables)
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0]
        out = {"rows": [], "ok": False, "error": f"{type(exc).__name__}: {text}"[:300]}
    result.write_text(json.dumps(out, default=str))
    return 0


def cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "/")


def print_section(name: str, out: dict) -> None:
    status = "ok" if out.get("ok") else f"FAILED ({out.get('error', 'a row failed')})"
    print(f"\n## {name}: {status}, {out.get('seconds', 0):.0f} s\n", flush=True)
    rows = out.get("rows") or []
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row if not isinstance(row[key], (list, dict))))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(cell(row.get(c)) for c in columns) + " |")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="each section's plumbing on the CPU (tiny sizes)")
    parser.add_argument("--only", help=f"comma-separated sections to run (of {', '.join(ORDER)})")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every section's time limit (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="write the tables this GPU measured here: the calibration table (perf-kernels, as "
        "perf_kernels.py --write) and the attention tuning table (attention, as attention.py --write-table)",
    )
    parser.add_argument("--section", nargs=3, metavar=("NAME", "RESULT", "LIMIT"), help=argparse.SUPPRESS)
    parser.add_argument("--recipe-worker", nargs=3, metavar=("RECIPE", "OVERRIDES", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--run-worker", nargs=2, metavar=("RECIPE_FILE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        name, result, limit = args.section
        return section_main(name, Path(result), float(limit), args.cpu, Path(args.out) if args.out else None)
    if args.recipe_worker or args.run_worker:
        import gpu_sections

        if args.recipe_worker:
            name, overrides, result = args.recipe_worker
            gpu_sections.recipe_worker(name, json.loads(overrides), Path(result))
        else:
            gpu_sections.run_worker(args.run_worker[0], Path(args.run_worker[1]))
        return 0
    chosen = [s for s in (args.only.split(",") if args.only else ORDER) if s not in args.skip.split(",")]
    unknown = [s for s in chosen if s not in ORDER]
    if unknown:
        parser.error(f"--only/--skip: unknown section {unknown[0]!r}; the sections are {', '.join(ORDER)}")
    if args.scale <= 0:
        parser.error("--scale must be above 0")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "benchmarks/gpu_check.py needs a CUDA GPU and found none; --cpu runs each section's plumbing "
                "on the CPU",
                file=sys.stderr,
            )
            return 2
    from gpu_sections import SECTIONS

    tables = Path(args.out).resolve() if args.out else None
    if tables is not None:
        tables.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in chosen:
            limit = (CPU_LIMIT if args.cpu else SECTIONS[name][1]) * args.scale
            print(f"# {name} (limit {limit:.0f} s)", flush=True)
            results[name] = run_section(name, args.cpu, limit, Path(tmp) / name, tables)
            print_section(name, results[name])
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s in all")
    summary = {"cpu": args.cpu, "seconds": seconds, "sections": results}
    line = json.dumps(summary, default=str)
    if args.json:
        Path(args.json).write_text(line)
    print(line)
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    if (REPO.parent / "shared" / "data").is_dir():  # a checkout's local data copies, else the download path
        os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))
    sys.exit(main())
