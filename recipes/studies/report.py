"""``builder study show|report``: a study's trials read back from its database as rows (the values
that vary, parameters, FLOPs, tokens, final and best validation loss, wall time, status), their
Pareto front of loss against compute, plots (loss against FLOPs per model family, the loss
curves, each tuning axis's sensitivity) and CSV/JSON exports.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from yamlformer.builder.analysis.report import human
from yamlformer.recipes.studies import store
from yamlformer.recipes.studies.schema import StudyFile
from yamlformer.recipes.studies.variants import axis_values, short_names, show

#: the columns of a row besides the axes, in table and CSV order
COLUMNS = (
    "params",
    "flops_per_token",
    "tokens",
    "flops",
    "final_val",
    "best_val",
    "wall_s",
    "status",
)
#: how the table heads them
HEADERS = {
    "flops_per_token": "FLOPs/token",
    "flops": "FLOPs",
    "final_val": "final val",
    "best_val": "best val",
    "wall_s": "wall s",
}


def rows(loaded: StudyFile, study) -> list[dict[str, Any]]:
    """One row per variant (its latest trial), in trial order."""
    axes = list(axis_values(loaded))
    out = []
    for trial in store.latest_trials(study):
        attrs = trial.user_attrs
        values = attrs.get("values") or {}
        row = {"trial": trial.number, "variant": attrs["variant"], "family": attrs.get("family", "")}
        row.update({axis: values.get(axis) for axis in axes})
        row.update(
            params=attrs.get("params"),
            flops_per_token=attrs.get("flops_per_token"),
            tokens=attrs.get("tokens") or _planned_tokens(attrs),
            flops=attrs.get("flops") or attrs.get("planned_flops"),
            final_val=attrs.get("final_val"),
            best_val=attrs.get("best_val"),
            wall_s=attrs.get("wall_s"),
            status=store.status(trial),
            error=attrs.get("error"),
            curve=attrs.get("curve") or [],
            tokens_per_step=attrs.get("tokens_per_step"),
            budget=attrs.get("budget") or {},
            downstream=attrs.get("downstream") or {},
        )
        out.append(row)
    return out


def _planned_tokens(attrs: dict) -> int | None:
    steps, per = attrs.get("planned_steps"), attrs.get("tokens_per_step")
    return steps * per if steps and per else None


def ranked(loaded: StudyFile, table: list[dict]) -> list[dict]:
    """Finished rows best first by the study's ``rank_by`` (validation loss, lowest first; a
    downstream ``TASK/METRIC``, highest first), then the rest in trial order."""
    key = loaded.study.rank_by

    def score(row):
        if key == "val_loss":
            return row["final_val"]
        value = row["downstream"].get(key)
        return -value if isinstance(value, (int, float)) else None

    done = [r for r in table if r["status"] == "complete" and score(r) is not None]
    return sorted(done, key=score) + [r for r in table if r not in done]


def pareto(table: list[dict]) -> list[dict]:
    """The finished rows no other beats on both compute and final loss, cheapest first."""
    done = sorted(
        (r for r in table if r["status"] == "complete" and r["flops"] and r["final_val"] is not None),
        key=lambda r: (r["flops"], r["final_val"]),
    )
    front, best = [], math.inf
    for row in done:
        if row["final_val"] < best:
            front.append(row)
            best = row["final_val"]
    return front


def print_table(loaded: StudyFile, table: list[dict], console=None) -> None:
    """The trials as a table (Pareto-front rows marked ``*``), then each failure's one line."""

    axes = list(axis_values(loaded))
    shorts = short_names(axes)
    front = {r["trial"] for r in pareto(table)}
    extra = sorted({k for r in table for k in r["downstream"]})
    out = Table(
        title=f"study {loaded.name}: {len(table)} trials (* on the Pareto front of loss vs FLOPs)",
        title_justify="left",
    )
    axis_heads = [a if a.startswith("budget.") else shorts[a] for a in axes]
    for column in ["trial", *axis_heads, *(HEADERS.get(c, c) for c in COLUMNS), *extra]:
        out.add_column(column, justify="left" if column == "status" else "right")

    def cell(value, how="") -> str:
        if value is None:
            return "-"
        if how == "human":
            return human(value)
        if how == "loss":
            return f"{value:.4f}"
        if how == "s":
            return f"{value:,.0f}"
        return show(value)

    for row in ranked(loaded, table):
        out.add_row(
            f"{row['trial']}{'*' if row['trial'] in front else ''}",
            *(cell(row[a]) for a in axes),
            cell(row["params"], "human"),
            cell(row["flops_per_token"], "human"),
            cell(row["tokens"], "human"),
            cell(row["flops"], "human"),
            cell(row["final_val"], "loss"),
            cell(row["best_val"], "loss"),
            cell(row["wall_s"], "s"),
            row["status"],
            *(cell(row["downstream"].get(k), "loss") for k in extra),
        )
    console = console or Console(width=200)
    console.print(out)
    for row in table:
        if row["error"]:
            console.print(f"trial {row['trial']} ({row['variant']}) {row['status']}: {row['error']}", highlight=False)


def export(loaded: StudyFile, table: list[dict], csv_path: Path | None, json_path: Path | None) -> None:
    """The rows as CSV (no curves) and JSON (everything)."""
    axes = list(axis_values(loaded))
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["trial", "variant", *axes, *COLUMNS, "error"])
            for row in table:
                writer.writerow(
                    [
                        row["trial"],
                        row["variant"],
                        *(row[a] for a in axes),
                        *(row[c] for c in COLUMNS),
                        row["error"] or "",
                    ]
                )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {"study": loaded.name, "trials": table, "pareto": [r["trial"] for r in pareto(table)]},
                indent=1,
                default=str,
            )
        )


# -- plots ---------------------------------------------------------------------------------------


def families(table: list[dict]) -> dict[str, list[dict]]:
    """Finished rows by model family (the values that change the model)."""
    out: dict[str, list[dict]] = {}
    for row in table:
        if row["status"] == "complete" and row["final_val"] is not None:
            out.setdefault(row["family"] or "all", []).append(row)
    return out


def plot(loaded: StudyFile, table: list[dict], folder: Path) -> list[Path]:
    """Write the study's plots into ``folder``; returns their paths (none when nothing finished)."""
    # optional extra: matplotlib (pip install 'yamlformer[plot]')
    import matplotlib

    matplotlib.use("Agg")
    # optional extra: matplotlib (pip install 'yamlformer[plot]')
    import matplotlib.pyplot as plt

    groups = families(table)
    if not groups:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = [_loss_vs_flops(plt, loaded, table, groups, folder / "loss-vs-flops.png")]
    written.append(_curves(plt, loaded, groups, folder / "loss-curves.png"))
    for axis in tuning_axes(loaded, table):
        written.append(_sensitivity(plt, loaded, groups, axis, folder))
    return written


def tuning_axes(loaded: StudyFile, table: list[dict]) -> list[str]:
    """Numeric axes that leave the model as it is and are not the budget (a learning rate)."""
    shorts = short_names(list(axis_values(loaded)))
    family_text = " ".join(r["family"] for r in table)
    return [
        axis
        for axis in axis_values(loaded)
        if not axis.startswith("budget.")
        and f"{shorts[axis]}=" not in family_text
        and all(
            isinstance(r[axis], (int, float)) and not isinstance(r[axis], bool) for r in table if r[axis] is not None
        )
    ]


def _colours(plt, n: int):
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(1, n - 1) * 0.9) for i in range(n)]


def _loss_vs_flops(plt, loaded, table, groups, path: Path) -> Path:
    """Final loss against training FLOPs, one line per family (the best of its other values at
    each budget), the Pareto front over all trials."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for colour, (family, members) in zip(_colours(plt, len(groups)), sorted(groups.items(), key=_by_size)):
        best: dict[float, float] = {}
        for r in members:
            best[r["flops"]] = min(best.get(r["flops"], math.inf), r["final_val"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], "o-", color=colour, label=family, alpha=0.85)
        ax.scatter([r["flops"] for r in members], [r["final_val"] for r in members], color=colour, s=10, alpha=0.4)
    front = pareto(table)
    ax.step(
        [r["flops"] for r in front], [r["final_val"] for r in front], "k--", where="post", lw=1, label="Pareto front"
    )
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{loaded.name}: loss vs compute")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curves(plt, loaded, groups, path: Path) -> Path:
    """Validation loss against FLOPs spent, every finished trial, coloured by family."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for colour, (family, members) in zip(_colours(plt, len(groups)), sorted(groups.items(), key=_by_size)):
        for i, r in enumerate(members):
            per = (r["tokens_per_step"] or 0) * (r["flops_per_token"] or 0)
            steps, losses = zip(*r["curve"]) if r["curve"] else ((), ())
            ax.plot([s * per for s in steps], losses, color=colour, alpha=0.7, lw=1, label=family if i == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs so far")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{loaded.name}: loss curves")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sensitivity(plt, loaded, groups, axis: str, folder: Path) -> Path:
    """Final loss against one tuning axis, one line per family and budget."""
    short = short_names(list(axis_values(loaded)))[axis]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for colour, (family, members) in zip(_colours(plt, len(groups)), sorted(groups.items(), key=_by_size)):
        budgets = sorted({json.dumps(r["budget"], sort_keys=True) for r in members})
        for style, budget in zip(("o-", "s--", "^:", "d-."), budgets):
            points = sorted(
                (r[axis], r["final_val"]) for r in members if json.dumps(r["budget"], sort_keys=True) == budget
            )
            shown = ", ".join(f"{k} {show(v)}" for k, v in json.loads(budget).items())
            ax.plot(*zip(*points), style, color=colour, alpha=0.8, lw=1, label=f"{family} ({shown})")
    values = [r[axis] for m in groups.values() for r in m]
    if min(values) > 0 and max(values) / min(values) >= 8:
        ax.set_xscale("log")
    ax.set_xlabel(axis)
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{loaded.name}: sensitivity to {short}")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = folder / f"sensitivity-{short.replace('.', '-')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _by_size(item):
    family, members = item
    return (min(r["params"] or 0 for r in members), family)
