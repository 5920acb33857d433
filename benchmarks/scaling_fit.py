"""Does a study's scaling-law fit predict a run it never saw? Fit Chinchilla's ``L(N, D)`` to a
finished study (``builder study fit``'s fit), take a compute budget ``--factor`` times the largest
any fitted trial spent, let the fit pick the study's spec for it (the one it predicts lowest),
train that spec at that budget with the study's best learning rate for it (a trial of the study's
own recipe, in its own run folder), and compare the measured final validation loss with the
prediction and its bootstrap interval. ``--seeds K`` trains the held-out run K times (the study's
own seed, then ``trainer.seed`` 1 to K-1: initialisation and data order) and compares the median,
since one run's seed is part of the noise the fit is judged against. ``--max-tokens D`` (the
tokens of one pass over the corpus's training split) keeps the pick to models that would not
repeat the corpus at that budget: the law takes every token as fresh.

    python benchmarks/scaling_fit.py recipes/studies/examples/tiny-lm.yaml --factor 4 --seeds 5 --jobs 2 --out fit.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="a study file whose sweep has finished")
    parser.add_argument("--factor", type=float, default=4.0, help="held-out compute / the largest fitted trial's")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples of the fit")
    parser.add_argument(
        "--seeds", type=int, default=1, help="held-out runs (the study's seed, then 1..K-1); the median is compared"
    )
    parser.add_argument("--jobs", type=int, default=1, help="held-out runs at once (processes)")
    parser.add_argument(
        "--max-tokens",
        type=float,
        help="one pass over the corpus's training split: the held-out spec is picked among the models that "
        "would not repeat it at the held-out budget (builder study fit --max-tokens)",
    )
    parser.add_argument("--out", help="also write the result here (JSON)")
    args = parser.parse_args()

    from yamlformer.recipes.studies import report, scaling, store
    from yamlformer.recipes.studies.schema import load_study
    from yamlformer.recipes.studies.variants import axis_values, budget_axis, check

    print(f"machine: {machine()}", flush=True)
    loaded = load_study(args.study)
    study, _ = store.open_study(loaded, create=False)
    table = report.rows(loaded, study)
    done = [r for r in table if r["status"] == "complete"]
    params, tokens, losses = scaling.study_points(done)
    fitted = scaling.fit(params, tokens, losses, bootstrap=args.bootstrap)
    residuals = [(float(fitted.law.loss(n, d)) - loss) / loss for n, d, loss in zip(params, tokens, losses)]
    rms = statistics.fmean(r * r for r in residuals) ** 0.5
    print(f"the fit on its {len(residuals)} points: residuals RMS {rms:.2%}, largest {max(map(abs, residuals)):.2%}")
    largest = max(r["flops"] for r in done)
    compute = args.factor * largest
    tuned = scaling.best_tuned(done)  # per model, its best tuning at its largest budget
    members = [{k: r[k] for k in ("params", "flops_per_token", "family")} for r in tuned.values()]
    chosen = scaling.best_member(fitted.law, members, compute, args.max_tokens)
    best = tuned[chosen["params"]]
    values = {k: best[k] for k in best if k in axis_values(loaded)}
    values[budget_axis(loaded)] = compute
    variants = [check(loaded, values if seed == 0 else {**values, "trainer.seed": seed}) for seed in range(args.seeds)]
    variant = variants[0]
    print(
        f"fitted {fitted.points} points (largest trial {largest:.3g} FLOPs); held out: {variant.name} at "
        f"{compute:.3g} FLOPs ({variant.steps:,} steps, {variant.tokens:,} tokens), {args.seeds} seed(s), "
        f"{args.jobs} at once",
        flush=True,
    )
    runs = _train_all(loaded, variants, args.jobs)
    if runs is None:
        return 1
    measured = statistics.median(r["measured"] for r in runs)
    trained = runs[0]["tokens"]
    predicted = float(fitted.law.loss(variant.params, trained))
    low, high = fitted.interval(lambda law: law.loss(variant.params, trained))
    error = (predicted - measured) / measured
    spread = (max(r["measured"] for r in runs) - min(r["measured"] for r in runs)) / measured
    print(
        f"held-out {variant.name}: measured {measured:.4f} (median of {len(runs)}, spread {spread:.2%}), "
        f"predicted {predicted:.4f} [{low:.4f}, {high:.4f}], error {error:+.2%}",
        flush=True,
    )
    return emit(
        {
            "benchmark": "scaling_fit",
            "machine": machine(),
            "study": loaded.name,
            "points": fitted.points,
            "law": fitted.law.to_dict(),
            "intervals": fitted.intervals(),
            "largest_fitted_flops": largest,
            "max_tokens": args.max_tokens,
            "held_out": variant.name,
            "held_out_flops": float(trained) * variant.flops_per_token,
            "params": variant.params,
            "tokens": trained,
            "measured": measured,
            "runs": runs,
            "seed_spread": spread,
            "predicted": predicted,
            "interval": [low, high],
            "relative_error": error,
            "fit_residual_rms": rms,
            "fit_residual_max": max(map(abs, residuals)),
        },
        args.out,
    )


def _train_all(loaded, variants, jobs: int) -> list[dict] | None:
    """Train each variant (one per seed) as the study trains a trial, ``jobs`` at once; per seed its
    final validation loss, tokens and seconds, or None (said on stderr) when a run fails."""
    from yamlformer.recipes.studies.runner import read_curve
    from yamlformer.recipes.studies.variants import train_command, trial_dir

    waiting, running, runs = list(enumerate(variants)), {}, {}
    while waiting or running:
        while waiting and len(running) < max(1, jobs):
            seed, variant = waiting.pop(0)
            run_dir = trial_dir(loaded, variant.name)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = (run_dir / "trial.log").open("ab")
            # the cores shared between the runs at once, as the study's runner shares them between
            # its trials (each run's own thread pool the size of the machine oversubscribes it)
            threads = str(max(1, (os.cpu_count() or 1) // max(1, jobs)))
            process = subprocess.Popen(
                ["nice", "-n", "19", *train_command(loaded, variant)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"OMP_NUM_THREADS": threads, **os.environ, "TQDM_DISABLE": "1"},
            )
            running[seed] = (process, log, variant, run_dir, time.time())
        time.sleep(1)
        for seed, (process, log, variant, run_dir, start) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            del running[seed]
            if process.returncode:
                print(
                    f"a held-out run failed (exit {process.returncode}); see {run_dir / 'trial.log'}", file=sys.stderr
                )
                for other, *_ in running.values():
                    other.terminate()
                return None
            curve, steps = read_curve(run_dir, variant.steps)
            runs[seed] = {"seed": seed, "measured": curve[-1][1], "tokens": steps * variant.tokens_per_step}
            runs[seed]["seconds"] = round(time.time() - start, 1)
            print(
                f"  seed {seed}: final val loss {runs[seed]['measured']:.4f} ({runs[seed]['seconds']:.0f} s)",
                flush=True,
            )
    return [runs[seed] for seed in sorted(runs)]


if __name__ == "__main__":
    raise SystemExit(main())
