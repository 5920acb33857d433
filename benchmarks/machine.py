"""The line every benchmark prints about where it ran (the results are only comparable within one machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def machine() -> str:
    """``"<cores> cores, <CPU model>"`` from ``/proc/cpuinfo`` (``unknown CPU`` where there is none)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {model}"


def emit(result: dict, path: str | None) -> int:
    """The benchmark's result as its last line of JSON (``run_all.sh`` keeps that line), and the
    same, indented, in ``path`` when one is given; returns the exit status 0."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0
