"""The line every benchmark prints about where it ran (the results are only comparable within one machine)."""

from __future__ import annotations

import os


def machine() -> str:
    """``"<cores> cores, <CPU model>"`` from ``/proc/cpuinfo`` (``unknown CPU`` where there is none)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {model}"
