"""Does the best learning rate transfer across widths? Learning-rate sweeps at several widths of one
small Llama-style decoder on the built-in corpus (Python's standard library), under the standard
parametrization and under muP (``parametrization: {type: mup, base_d_model: <the smallest width>}``),
as one study (``builder sweep``: a variant per parametrization x width x learning rate, each a
trial of the study runner). Under muP the best learning rate should be the same grid point at
every width; under the standard parametrization it moves (down) as the width grows. Prints the
best grid point per width, writes the loss-vs-learning-rate curves as a PNG and the numbers as JSON.

    python benchmarks/mup_transfer.py --out mup.json --png mup_transfer.png
    python benchmarks/mup_transfer.py --widths 64 128 --lrs -10 -8 -6 --steps 60   # a quick look
    python benchmarks/mup_transfer.py --widths 512 --base 64 --also runs/mup-transfer/mup-transfer-64-128-256.yaml
    python benchmarks/mup_transfer.py --seed 2 --folder runs/mup-2 \
        --also runs/mup-transfer/mup-transfer-64-128-256-512.yaml   # a second seed, averaged with the first

Trials of several seeds (``--seed``, each study in a folder of its own, joined by ``--also``) are
averaged per parametrization, width and learning rate before the best points are read.

Learning rates are powers of two (``--lrs`` gives the exponents). Runs on the CPU; a rerun resumes
the study where it stopped (``--folder``).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine

HERE = Path(__file__).resolve().parent


def study_file(
    folder: Path, widths, exponents, steps: int, seq_len: int, batch: int, layers: int, base: int, seed=None
):
    """The study: variants standard | mup (from ``base``), axes d_model x optimizer.lr, a budget of
    ``steps``; ``seed``: every trial's ``trainer.seed`` (None: the recipe's)."""
    study = {
        "name": "mup-transfer-" + "-".join(map(str, widths)) + (f"-seed{seed}" if seed is not None else ""),
        "recipe": str(HERE.parent / "recipes" / "lm-stdlib.yaml"),
        "set": {
            "data.max_bytes": 1_000_000,
            "data.seq_len": seq_len,
            "data.batch_size": batch,
            "tokenizer.vocab_size": 1024,
            "decoder.n_layers": layers,
            "decoder.attention.n_heads": 4,  # fixed: the head width grows with d_model (muP's default)
            "decoder.attention.n_kv_heads": 4,
            "decoder.ffn.hidden_dim": None,  # 4 x d_model: the FFN grows with the width
            "schedule.warmup_steps": max(1, steps // 10),
            "schedule.min_lr": 0.0,
            "trainer.precision": "32",
            "trainer.limit_val_batches": 20,
            "trainer.max_time": None,
        },
        "variants": {
            "standard": {},
            "mup": {"parametrization": {"type": "mup", "base_d_model": base}},
        },
        "axes": {"d_model": list(widths), "optimizer.lr": [2.0**e for e in exponents]},
        "budget": {"steps": steps, "validations": 2},
        "parallel": {"trials": 1},
        "output_dir": str(folder / "study"),
        "storage": f"sqlite:///{folder / 'study.db'}",
    }
    if seed is not None:
        study["set"]["trainer.seed"] = seed
    path = folder / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def averaged(rows) -> list[dict]:
    """One row per parametrization, width and learning rate: the mean final validation loss of its
    complete trials (every seed's), ``seeds`` how many; NaN when a seed diverged."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        if row["status"] == "complete" and row["final_val"] is not None:
            groups.setdefault((row["variant"], row["d_model"], row["optimizer.lr"]), []).append(row["final_val"])
    return [
        {
            "variant": kind,
            "d_model": width,
            "optimizer.lr": lr,
            "final_val": sum(values) / len(values),
            "seeds": len(values),
            "status": "complete",
        }
        for (kind, width, lr), values in groups.items()
    ]


def finished(row) -> bool:
    """Whether a trial (or averaged point) ended with a finite final validation loss."""
    return row["status"] == "complete" and row["final_val"] is not None and math.isfinite(row["final_val"])


def best_points(rows) -> dict[str, dict[int, float]]:
    """Per parametrization and width, the learning rate with the lowest final validation loss."""
    best: dict[str, dict[int, tuple[float, float]]] = {}
    for row in filter(finished, rows):
        kind, width, lr = row["variant"], row["d_model"], row["optimizer.lr"]
        current = best.setdefault(kind, {}).get(width)
        if current is None or row["final_val"] < current[1]:
            best[kind][width] = (lr, row["final_val"])
    return {kind: {w: lr for w, (lr, _) in sorted(by.items())} for kind, by in best.items()}


def optimum(points: list[tuple[float, float]]) -> float | None:
    """The log2 learning rate at the bottom of the parabola through the best grid point and its two
    neighbours (``points``: ``(log2 lr, loss)``); the best point itself when it lies on the grid's
    edge (the optimum may be beyond it), None without points. One seed's best grid point can hop
    between two neighbours whose losses nearly tie; the vertex says where between them it lies."""
    points = sorted(points)
    if not points:
        return None
    i = min(range(len(points)), key=lambda k: points[k][1])
    if i == 0 or i == len(points) - 1:
        return points[i][0]
    (x0, y0), (x1, y1), (x2, y2) = points[i - 1 : i + 2]
    # the first lowest point: y0 > y1 <= y2, so the parabola opens upwards; the grid is even (factors of 2)
    return x1 + (x1 - x0) * (y0 - y2) / (2 * (y0 - 2 * y1 + y2))


def optima(rows) -> dict[str, dict[int, float]]:
    """Per parametrization and width, :func:`optimum` of its loss-vs-learning-rate curve."""
    out: dict[str, dict[int, float]] = {}
    for kind in ("standard", "mup"):
        for width in sorted({r["d_model"] for r in rows if r["variant"] == kind}):
            points = [
                (math.log2(r["optimizer.lr"]), r["final_val"])
                for r in rows
                if r["variant"] == kind and r["d_model"] == width and finished(r)
            ]
            found = optimum(points)
            if found is not None:
                out.setdefault(kind, {})[width] = found
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("standard", "mup")):
        widths = sorted({r["d_model"] for r in rows if r["variant"] == kind})
        for width in widths:
            points = sorted(
                (r["optimizer.lr"], r["final_val"])
                for r in rows
                if r["variant"] == kind and r["d_model"] == width and r["status"] == "complete" and r["final_val"]
            )
            if points:
                ax.plot(
                    [math.log2(lr) for lr, _ in points], [v for _, v in points], marker="o", label=f"d_model {width}"
                )
        ax.set_title("standard parametrization" if kind == "standard" else "muP")
        ax.set_xlabel("log2 learning rate")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("final validation loss")
    finite = [r["final_val"] for r in rows if r["final_val"] is not None and math.isfinite(r["final_val"])]
    if finite:
        low = min(finite)
        axes[0].set_ylim(low - 0.05, min(max(finite), low + 2.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512], help="d_model values")
    parser.add_argument(
        "--lrs", type=int, nargs="+", default=[-12, -11, -10, -9, -8, -7, -6], help="log2 of the learning rates"
    )
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per trial")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--base", type=int, help="muP's base_d_model (default: the smallest width)")
    parser.add_argument("--seed", type=int, help="every trial's trainer.seed (default: the recipe's)")
    parser.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="finished study files of this script (other widths) whose trials join the report",
    )
    parser.add_argument("--folder", default="runs/mup-transfer", help="the study's folder (a rerun resumes it)")
    parser.add_argument("--png", default="mup_transfer.png", help="the loss-vs-learning-rate curves")
    parser.add_argument("--out", help="also write the result here (JSON)")
    args = parser.parse_args()

    from yamlformer.recipes.studies import report, store
    from yamlformer.recipes.studies.schema import load_study

    print(f"machine: {machine()}", flush=True)
    folder = Path(args.folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    base = args.base or min(args.widths)
    path = study_file(folder, args.widths, args.lrs, args.steps, args.seq_len, args.batch, args.layers, base, args.seed)
    code = subprocess.call([sys.executable, "-m", "yamlformer.builder.cli", "sweep", str(path)])
    trials = []
    for each in [path, *map(Path, args.also)]:
        loaded = load_study(each)
        trials += report.rows(loaded, store.open_study(loaded, create=False)[0])
    rows = averaged(trials)
    seeds = sorted({r["seeds"] for r in rows})
    print(f"{len(trials)} trials; {len(rows)} points, each the mean of {'/'.join(map(str, seeds))} seed(s)")
    widths = sorted({r["d_model"] for r in rows})
    best = best_points(rows)
    vertices = optima(rows)
    for kind in ("standard", "mup"):
        shown = ", ".join(f"{w}: 2^{round(math.log2(lr))}" for w, lr in best.get(kind, {}).items())
        print(f"{kind}: best learning rate by width: {shown}")
        found = vertices.get(kind, {})
        spread = max(found.values()) - min(found.values()) if found else float("nan")
        shown = ", ".join(f"{w}: 2^{x:.2f}" for w, x in found.items())
        print(f"{kind}: interpolated optimum by width: {shown} (spread {spread:.2f} grid points)")
    plot(rows, Path(args.png))
    grid = {
        kind: {
            str(w): {
                f"2^{round(math.log2(r['optimizer.lr']))}": r["final_val"]
                for r in rows
                if r["variant"] == kind and r["d_model"] == w and r["status"] == "complete"
            }
            for w in widths
        }
        for kind in ("standard", "mup")
    }
    moved = {kind: len(set(best.get(kind, {}).values())) > 1 for kind in ("standard", "mup")}
    result = {
        "benchmark": "mup_transfer",
        "machine": machine(),
        "widths": widths,
        "base_d_model": base,
        "lrs": [f"2^{e}" for e in args.lrs],
        "steps": args.steps,
        "best_lr": {k: {str(w): lr for w, lr in v.items()} for k, v in best.items()},
        "best_moves": moved,
        "interpolated_log2_optimum": {k: {str(w): round(x, 3) for w, x in v.items()} for k, v in vertices.items()},
        "final_val": grid,
        "trials": len(trials),
        "seeds_per_point": seeds,
        "sweep_exit": code,
        "png": str(Path(args.png).resolve()),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
