"""Cooldowns branched from one warmup-stable-decay run against cosine runs of the same length.

For each seed: one stable run (``schedule.type: wsd``, its own decay at the end) keeping whole
checkpoints every ``--every`` steps; from three of them a cooldown (``builder train
--cooldown-from CKPT --steps N``: ``N = --cooldown`` share of the branch's total length) decays the
learning rate to ``min_lr``; and for each branch a cosine run of the same total length (warmup,
peak and floor alike, same seed and data). Printed: each branch's final validation loss against
the cosine run's, per seed and as the median of the differences, and the seeds' spread; the last
line is JSON. The recipe is shakespeare-char as shipped (its model, data, peak and floor) unless
``--recipe`` names another.

    python benchmarks/wsd_cooldown.py --seeds 1 2 3 --out wsd.json
    python benchmarks/wsd_cooldown.py --seeds 1 --stable 40 --every 10 --branches 10 20 --warmup 5   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine
from recipe_runs import REPO, add_output_options, runs_folder, train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "shakespeare-char.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--stable", type=int, default=1000, help="the stable run's steps (its own decay: the last 20%%)"
    )
    parser.add_argument("--every", type=int, default=250, help="steps between the stable run's kept checkpoints")
    parser.add_argument("--branches", type=int, nargs="+", default=[250, 500, 750], help="steps to branch at")
    parser.add_argument("--cooldown", type=float, default=0.2, help="the cooldown's share of a branch's total length")
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--warmup", type=int, help="warmup steps of every run (default: the recipe's)")
    add_output_options(parser)
    args = parser.parse_args()

    from yamlformer.recipes.training.cooldown import cooldown

    print(f"machine: {machine()}", flush=True)
    root = runs_folder(args, "wsd-")
    common = {"trainer.val_check_interval": args.val_every, "trainer.max_time": None, "schedule.decay_steps": None}
    if args.warmup is not None:
        common["schedule.warmup_steps"] = args.warmup
    rows = []
    for seed in args.seeds:
        seeded = {**common, "trainer.seed": seed}
        stable_dir = root / f"seed{seed}" / "stable"
        stable = {
            **seeded,
            "schedule.type": "wsd",
            "schedule.decay_fraction": 0.2,
            "trainer.max_steps": args.stable,
            "trainer.keep_every_n_steps": args.every,
            "trainer.checkpoint_every_n_steps": args.every,
        }
        summary = train(args.recipe, stable, stable_dir)
        print(f"seed {seed}: stable run of {args.stable} steps: val {summary['val_loss']:.4f}", flush=True)
        for branch in args.branches:
            steps = max(1, round(branch * args.cooldown / (1 - args.cooldown)))
            ckpt = stable_dir / "checkpoints" / f"branch-{branch}.ckpt"
            overrides = {**stable, "trainer.output_dir": str(stable_dir)}
            cooled = cooldown(args.recipe, overrides, ckpt, steps, samples=False)
            total = branch + steps
            cosine = train(
                args.recipe, {**seeded, "trainer.max_steps": total}, root / f"seed{seed}" / f"cosine-{total}"
            )
            rows.append(
                {
                    "seed": seed,
                    "branch": branch,
                    "cooldown_steps": steps,
                    "total_steps": total,
                    "wsd_val": cooled["val_loss"],
                    "cosine_val": cosine["val_loss"],
                    "difference": cooled["val_loss"] - cosine["val_loss"],
                }
            )
            print(
                f"seed {seed}: branch at {branch} + {steps} cooldown = {total} steps: wsd {cooled['val_loss']:.4f}, "
                f"cosine {cosine['val_loss']:.4f} ({cooled['val_loss'] - cosine['val_loss']:+.4f})",
                flush=True,
            )
    by_branch = {}
    for branch in args.branches:
        mine = [r for r in rows if r["branch"] == branch]
        cosine_spread = statistics.pstdev([r["cosine_val"] for r in mine]) if len(mine) > 1 else None
        by_branch[str(branch)] = {
            "total_steps": mine[0]["total_steps"],
            "median_wsd": statistics.median(r["wsd_val"] for r in mine),
            "median_cosine": statistics.median(r["cosine_val"] for r in mine),
            "median_difference": statistics.median(r["difference"] for r in mine),
            "cosine_seed_spread": cosine_spread,
        }
        shown = by_branch[str(branch)]
        print(
            f"branch {branch} ({shown['total_steps']} steps): median wsd {shown['median_wsd']:.4f}, cosine "
            f"{shown['median_cosine']:.4f}, difference {shown['median_difference']:+.4f}"
            + (f" (cosine's seed spread {cosine_spread:.4f})" if cosine_spread is not None else "")
        )
    result = {
        "benchmark": "wsd_cooldown",
        "machine": machine(),
        "recipe": Path(args.recipe).name,
        "seeds": args.seeds,
        "stable_steps": args.stable,
        "branches": by_branch,
        "runs": rows,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
