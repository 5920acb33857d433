"""Muon against the tuned AdamW recipe: steps and wall seconds to AdamW's final validation loss.

For each recipe (shakespeare-char, lm-stdlib: their models, data, schedules and AdamW settings as
shipped) and each seed, two runs in this process, alternating which goes first: the recipe as it
is, and the same recipe with ``optimizer: {type: muon}`` on its hidden matrices and the recipe's
AdamW on every other tensor. Muon's settings are Moonshot's ("Muon is scalable", 2025): the update
scaled to AdamW's size (``adjust_lr: match_rms_adamw``), so the recipe's own learning rate and
weight decay serve both (no tuning for Muon here). Printed per recipe: each run's final
validation loss, where Muon's curve first reaches AdamW's final loss (steps and wall seconds,
interpolated between validations), and the medians over seeds of the step and wall-time ratios
(Muon / AdamW); the last line is JSON.

    python benchmarks/muon_vs_adamw.py --out muon.json
    python benchmarks/muon_vs_adamw.py --recipes shakespeare-char --seeds 1 --steps 100   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine
from recipe_runs import REPO, add_output_options, reaches, runs_folder, train

#: how often each recipe validates here: often enough to place the crossing
VAL_EVERY = {"shakespeare-char": 100, "lm-stdlib": 50}


def muon_settings(recipe) -> dict:
    """Muon on the hidden matrices with the recipe's AdamW on the rest: one learning rate and decay for both."""
    opt = recipe.optimizer
    return {
        "optimizer": {
            "type": "muon",
            "lr": opt.lr,
            "adamw_lr": opt.lr,
            "betas": list(opt.betas),
            "eps": opt.eps,
            "weight_decay": opt.weight_decay,
            "decay_embeddings": opt.decay_embeddings,
            "adjust_lr": "match_rms_adamw",
        }
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["shakespeare-char", "lm-stdlib"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, help="max_steps of every run (default: each recipe's; its decay follows)")
    add_output_options(parser)
    args = parser.parse_args()

    from yamlformer.recipes.tasks import load_recipe

    print(f"machine: {machine()}", flush=True)
    root = runs_folder(args, "muon-")
    results = {}
    for name in args.recipes:
        path = REPO / "recipes" / f"{name}.yaml"
        base = {"trainer.val_check_interval": VAL_EVERY.get(name, 100), "trainer.max_time": None}
        if args.steps is not None:
            base.update({"trainer.max_steps": args.steps, "schedule.decay_steps": None})
        muon = {f"optimizer.{k}": v for k, v in muon_settings(load_recipe(path).recipe)["optimizer"].items()}
        rows = []
        for i, seed in enumerate(args.seeds):
            runs = {}
            order = ("adamw", "muon") if i % 2 == 0 else ("muon", "adamw")
            for kind in order:
                overrides = {**base, "trainer.seed": seed, **(muon if kind == "muon" else {})}
                runs[kind] = train(path, overrides, root / name / f"{kind}-{seed}")
            target = runs["adamw"]["val_loss"]
            adamw_end = runs["adamw"]["val_curve"][-1]
            crossing = reaches(runs["muon"]["val_curve"], target)
            row = {
                "seed": seed,
                "adamw_val": target,
                "muon_val": runs["muon"]["val_loss"],
                "adamw_steps": adamw_end[0],
                "adamw_wall_s": adamw_end[2],
                "muon_steps_to_target": crossing[0] if crossing else None,
                "muon_wall_s_to_target": crossing[1] if crossing else None,
                "muon_wall_s": runs["muon"]["val_curve"][-1][2],
            }
            rows.append(row)
            shown = f"{crossing[0]:.0f} steps, {crossing[1]:.0f} s" if crossing else "not reached"
            print(
                f"{name} seed {seed}: adamw {target:.4f} at {adamw_end[0]} steps ({adamw_end[2]:.0f} s); "
                f"muon {row['muon_val']:.4f}; muon reaches adamw's final loss at {shown}",
                flush=True,
            )
        reached = [r for r in rows if r["muon_steps_to_target"] is not None]
        summary = {
            "runs": rows,
            "median_adamw_val": statistics.median(r["adamw_val"] for r in rows),
            "median_muon_val": statistics.median(r["muon_val"] for r in rows),
            "reached": f"{len(reached)} of {len(rows)}",
        }
        if reached:
            summary["median_step_ratio"] = statistics.median(
                r["muon_steps_to_target"] / r["adamw_steps"] for r in reached
            )
            summary["median_wall_ratio"] = statistics.median(
                r["muon_wall_s_to_target"] / r["adamw_wall_s"] for r in reached
            )
            summary["median_wall_per_step_ratio"] = statistics.median(
                (r["muon_wall_s"] / r["adamw_wall_s"]) for r in rows
            )
        results[name] = summary
        print(
            f"{name}: median final val adamw {summary['median_adamw_val']:.4f}, muon {summary['median_muon_val']:.4f}; "
            + (
                f"muon reaches adamw's final loss in {summary['median_step_ratio']:.2f}x the steps and "
                f"{summary['median_wall_ratio']:.2f}x the wall time ({summary['reached']} seeds)"
                if reached
                else "muon never reached adamw's final loss"
            ),
            flush=True,
        )
    return emit({"benchmark": "muon_vs_adamw", "machine": machine(), "seeds": args.seeds, "recipes": results}, args.out)


if __name__ == "__main__":
    sys.exit(main())
