"""Precision and compilation on this machine, side by side: each shipped recipe trained in fp32 and
bf16 autocast, compiled and eager, and what ``trainer.precision: auto`` would pick.

    python benchmarks/precision.py [--recipes shakespeare-char lm-stdlib] [--steps 200] [--rounds 2]
                                   [--variants 32:eager 32:compiled bf16-mixed:eager bf16-mixed:compiled]
                                   [--set KEY=VALUE ...] [--json FILE]

Each variant is ``builder train RECIPE`` as a user runs it, in a fresh process and a new output
folder (so a compiled run pays its cold compile), with ``trainer.precision`` and
``trainer.compile`` forced and the same seed, for ``--steps`` steps (the schedule's decay ends
there). Variants run in a rotating order, round after round, so a slow minute of a shared
machine falls on each in turn. Printed per recipe: median tokens/s over the rounds (the
recipe's own 10-step-interval median, compilation left out), each variant's ratio against fp32
eager in the same round, compile seconds, whole-run seconds and the final validation loss (quality
is kept when bf16's loss is level with fp32's). The last line is JSON with all of it.

``recipes/training/precision.py`` says which precision ``auto`` picks on a CPU from what this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine  # benchmarks/machine.py

REPO = Path(__file__).resolve().parents[1]
if (REPO.parent / "shared" / "data").is_dir():  # a checkout's local data copies, else the download path
    os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))

VARIANTS = ["32:eager", "32:compiled", "bf16-mixed:eager", "bf16-mixed:compiled"]
BASELINE = "32:eager"


def variant_overrides(variant: str, steps: int) -> dict:
    precision, _, mode = variant.partition(":")
    if mode not in ("eager", "compiled"):
        raise SystemExit(f"--variants {variant!r}: give PRECISION:eager or PRECISION:compiled")
    return {
        "trainer.precision": precision,
        "trainer.compile": mode == "compiled",
        "trainer.max_steps": steps,
        "trainer.max_time": None,
        "schedule.decay_steps": steps,
        "trainer.val_check_interval": steps,
    }


def worker(recipe: str, variant: str, steps: int, settings: list[str]) -> dict:
    from yamlformer.builder.spec.loader import parse_set_args
    from yamlformer.recipes.recipe.sections import recipe_path
    from yamlformer.recipes.training.run import run

    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        overrides = dict(
            parse_set_args(settings),
            **variant_overrides(variant, steps),
            **{"trainer.output_dir": str(Path(tmp) / "run")},
        )
        started = time.perf_counter()
        summary = run(recipe_path(recipe), overrides, fresh=True, samples=False)
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "compile_seconds": summary["compile_seconds"],
        "run_seconds": time.perf_counter() - started,
        "val_loss": summary["val_loss"],
        "train_loss": summary["train_loss"],
    }


def run_worker(recipe: str, variant: str, steps: int, settings: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    command = [sys.executable, __file__, "--worker", recipe, variant, str(steps), str(out)]
    for setting in settings:
        command += ["--set", setting]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"{recipe} {variant} failed:\n{done.stdout[-4000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def auto_choice(recipe: str) -> str:
    """What ``trainer.precision: auto`` resolves to for this recipe on this machine."""
    from yamlformer.recipes.recipe.sections import recipe_path
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import for_this_machine

    path = recipe_path(recipe)
    return for_this_machine(load_recipe(path, {"trainer.precision": "auto"}).recipe, quiet=True).trainer.precision


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["shakespeare-char", "lm-stdlib"])
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant (default 2)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=VARIANTS,
        help=f"PRECISION:eager|compiled (default: "
        f"{' '.join(VARIANTS)}); ratios are against {BASELINE}, which is added when missing",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe field for every run (as builder train --set), e.g. eval.max_sentences=100",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        recipe, variant, steps, result = args.worker
        Path(result).write_text(json.dumps(worker(recipe, variant, int(steps), args.set)))
        return 0
    variants = list(dict.fromkeys([BASELINE, *args.variants]))
    for variant in variants:
        variant_overrides(variant, args.steps)  # each checked before the first run

    print(
        f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}; started {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    results: dict = {"machine": machine(), "steps": args.steps, "recipes": {}}
    for recipe in args.recipes:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            for variant in order:
                result = run_worker(recipe, variant, args.steps, args.set)
                runs[variant].append(result)
                print(
                    f"{recipe} round {round_ + 1} {variant:20s}: {result['tokens_per_s']:9,.0f} tokens/s, val "
                    f"{result['val_loss']:.4f}, compile {result['compile_seconds']:.1f} s, run "
                    f"{result['run_seconds']:.1f} s",
                    flush=True,
                )
        table = {}
        for variant, rs in runs.items():
            ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, runs[BASELINE])]
            table[variant] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "run_ratio": statistics.median(b["run_seconds"] / r["run_seconds"] for r, b in zip(rs, runs[BASELINE])),
                "compile_seconds": statistics.median(r["compile_seconds"] for r in rs),
                "val_loss": statistics.mean(r["val_loss"] for r in rs),
                "runs": rs,
            }
        results["recipes"][recipe] = {"variants": table, "auto": auto_choice(recipe)}
        print(
            f"\n{recipe}: {args.steps} steps, {args.rounds} rounds; ratios against {BASELINE} in the same round; "
            f"auto picks {results['recipes'][recipe]['auto']} here"
        )
        print(f"{'variant':20s} {'tokens/s':>10s} {'ratio':>7s} {'whole run':>10s} {'compile s':>10s} {'val loss':>9s}")
        for variant, row in table.items():
            print(
                f"{variant:20s} {row['tokens_per_s']:10,.0f} {row['ratio']:6.2f}x {row['run_ratio']:9.2f}x "
                f"{row['compile_seconds']:10.1f} {row['val_loss']:9.4f}"
            )
        print(flush=True)
    return emit(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
