"""A run's curves from its run folder alone, for a user with no tracker: the CSV log that
``yamlformer.recipes.training.run_log`` writes (its latest version, which a resumed run
continues), ``config.yaml`` and ``estimate.json``. Four panels: training and validation loss,
the learning rate, tokens/s with MFU beside it, and the peak memory against the estimate per rank.
As a PNG (matplotlib, the ``plot`` extra) and as one self-contained HTML page (the same figure as
inline SVG, its text kept as text, and a table of what each series reached)."""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.training.run_log import CONFIG, ESTIMATE, GIB

#: the measured peak memory's columns, by what each measures (``run_log.peak_memory``)
MEMORY = {"cuda_max_allocated_gib": "CUDA max allocated", "process_peak_rss_gib": "process peak RSS"}
#: figure size in inches at :data:`DPI`: a 1200 x 800 pixel PNG
SIZE, DPI = (12, 8), 100


@dataclass
class RunCurves:
    """What a run folder holds to draw: each column of its CSV as ``(step, value)`` pairs."""

    folder: Path
    log: Path
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)
    name: str = ""

    def get(self, key: str) -> list[tuple[int, float]]:
        return self.series.get(key, [])

    def validation_keys(self) -> list[str]:
        """``val_loss`` first, then any other validation metric a task logs (``val_acc``...)."""
        found = sorted(k for k in self.series if k.startswith("val_"))
        return sorted(found, key=lambda k: k != "val_loss")

    def memory_estimate_gib(self) -> float | None:
        est = self.estimate.get("memory_per_rank_bytes")
        return est / GIB if isinstance(est, (int, float)) and est > 0 else None


def latest_log(folder: Path) -> Path:
    """``logs/version_N/metrics.csv`` with the highest N (a resumed run continues the latest)."""
    versions = []
    logs = folder / "logs"
    if logs.is_dir():
        for path in logs.iterdir():
            if (m := re.fullmatch(r"version_(\d+)", path.name)) and (path / "metrics.csv").is_file():
                versions.append((int(m.group(1)), path / "metrics.csv"))
    if not versions:
        raise RecipeError(
            f"RUN {folder}: no logs/version_N/metrics.csv (a run folder of builder train with csv logging)"
        )
    return max(versions)[1]


def read_run(folder: str | Path) -> RunCurves:
    """The curves of the run folder ``folder`` (raises :class:`RecipeError`, one line)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RecipeError(f"RUN {folder}: not a folder (give a run's trainer.output_dir)")
    log = latest_log(folder)
    curves = RunCurves(folder, log, name=folder.resolve().name)
    try:
        with open(log, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                step = _number(row.get("step"))
                if step is None:
                    continue
                for key, text in row.items():
                    value = _number(text)
                    if key not in ("step", "epoch") and key is not None and value is not None:
                        curves.series.setdefault(key, []).append((int(step), value))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise RecipeError(f"RUN {folder}: {log.name} cannot be read ({type(exc).__name__})") from None
    if not curves.series:
        raise RecipeError(f"RUN {folder}: {log} has no metrics yet")
    curves.estimate = _json(folder / ESTIMATE)
    config = _yaml_name(folder / CONFIG)
    curves.name = config or curves.name
    return curves


def _number(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _yaml_name(path: Path) -> str:
    """The recipe's ``name`` from ``config.yaml`` (safely read; empty when there is none)."""
    import yaml  # local: the report reads one field of one file

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return ""
    name = config.get("name") if isinstance(config, dict) else None
    return str(name)[:200] if name else ""


def pyplot():
    """matplotlib's pyplot on the file-only backend, or one line naming the extra."""
    try:
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib

        matplotlib.use("Agg")
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib.pyplot as plt
    except ImportError:
        raise RecipeError("matplotlib is not installed: pip install 'yamlformer[plot]'") from None
    return plt


def figure(curves: RunCurves):
    """The run's four panels as one matplotlib figure; each line is labelled with its CSV column."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=SIZE, dpi=DPI)
    (loss, lr), (speed, memory) = axes
    _lines(loss, curves, ["loss", *curves.validation_keys()], "loss (nats/token)", markers="val_")
    _lines(lr, curves, ["lr"], "learning rate")
    _lines(speed, curves, ["tok/s"], "tokens/s")
    if curves.get("MFU"):
        twin = speed.twinx()
        _lines(twin, curves, ["MFU"], "MFU", style="--", color="tab:red")
    measured = [key for key in MEMORY if curves.get(key)]
    _lines(memory, curves, measured, "GiB", labels=MEMORY)
    est = curves.memory_estimate_gib()
    if est is not None:
        memory.axhline(est, color="tab:gray", ls=":", label="estimate per rank")
        memory.legend(loc="best", fontsize=8)
    titles = ["loss", "learning rate", "throughput", "peak memory against the estimate"]
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(curves.name)
    fig.tight_layout()
    return fig


def _lines(ax, curves: RunCurves, keys, ylabel: str, markers: str = "", labels=None, style="-", color=None):
    drawn = False
    for key in keys:
        points = curves.get(key)
        if not points:
            continue
        steps, values = zip(*points)
        marker = "o" if markers and key.startswith(markers) else None
        ax.plot(steps, values, style, marker=marker, ms=3, lw=1, color=color, label=(labels or {}).get(key, key))
        drawn = True
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def write_png(curves: RunCurves, path: Path) -> Path:
    plt = pyplot()
    fig = figure(curves)
    fig.savefig(path, format="png", dpi=DPI)
    plt.close(fig)
    return path


def write_html(curves: RunCurves, path: Path) -> Path:
    """One page with nothing to fetch: the figure inline as SVG (text kept as text) and a table
    of each series' last value, its least and most, and its steps."""
    plt = pyplot()
    with plt.rc_context({"svg.fonttype": "none"}):
        fig = figure(curves)
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        plt.close(fig)
    body = svg.getvalue()
    body = body[body.index("<svg") :]  # the <svg> element alone, without the XML prologue
    rows = []
    for key, points in curves.series.items():
        values = [v for _, v in points]
        rows.append(
            f"<tr><td>{html.escape(key)}</td><td>{points[-1][1]:.6g}</td><td>{min(values):.6g}</td>"
            f"<td>{max(values):.6g}</td><td>{points[0][0]}&ndash;{points[-1][0]} ({len(points)})</td></tr>"
        )
    est = curves.memory_estimate_gib()
    estimate = f"<p>estimated memory per rank: {est:.4g} GiB</p>" if est is not None else ""
    title = html.escape(curves.name)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}: run report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}</style>
</head><body>
<h1>{title}</h1>
<p>from {html.escape(curves.log.name)} in {html.escape(str(curves.log.parent.relative_to(curves.folder)))}</p>
{body}
{estimate}
<table><tr><th>series</th><th>last</th><th>min</th><th>max</th><th>steps (points)</th></tr>
{chr(10).join(rows)}
</table>
</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
