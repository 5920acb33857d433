"""nanoGPT's CPU shakespeare_char run: the recipe against a plain-PyTorch yardstick, side by side.

    python benchmarks/shakespeare_char.py [--seeds 1337 7 42] [--max-steps 2000] [--set KEY=VALUE ...]
                                          [--json FILE]

For each seed, in alternating order (yardstick first for the first seed, recipe first for the
second, ...), each in a fresh process on the same machine in the same minutes:

* the **recipe**: ``builder train recipes/shakespeare-char.yaml`` as a user runs it (its precision,
  compile, checkpoints and logging included), in a new output folder, so a compiled run pays a cold
  compile; ``--set trainer.precision=32 --set trainer.compile=true`` measures another setting;
* the **yardstick**: ``benchmarks/yardstick.py``, nanoGPT's model and loop written from the
  definitions in plain PyTorch (eager, fp32 on a CPU, AdamW ``foreach``; no code of this project).

Both train on the identical batches (the recipe's windows for that seed: micro-batch ``i`` is a
pure function of ``(seed, i)``), validate on the same 20 held-out batches every 250 steps, with
the same optimizer, schedule and clipping, and start from the same weights (the recipe's seeded
init, copied into the yardstick's layout; ``--own-init`` gives the yardstick its own draw of the
same distribution). Timing leaves out process start and setup; it includes validation, and for
the recipe its compilation, checkpoints and logs.

Printed: tokens/s (median over 10-step intervals), compile seconds, wall seconds for the whole
run, final validation loss, and the wall seconds to reach the yardstick's median final loss,
for every run; then the ratios. The last line is JSON with all of it.
"""

from __future__ import annotations

import argparse
import json
import math
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
RECIPE = REPO / "recipes" / "shakespeare-char.yaml"
# the data comes through the dataset registry (recipes/data/registry.py): BUILDER_DATA, else a checkout's
# local copy at ../shared/data when there is one, else downloaded once into the user cache
if (REPO.parent / "shared" / "data").is_dir():
    os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))


# -- the two workers (each runs in its own process) -------------------------------------------------


def _overrides(seed: int, max_steps: int | None) -> dict:
    overrides = {"trainer.seed": seed}
    if max_steps is not None:
        overrides.update({"trainer.max_steps": max_steps, "schedule.decay_steps": max_steps})
    return overrides


def nanogpt_state(ours: dict, n_layers: int) -> dict:
    """The built model's tensors under the yardstick's names (q, k and v stacked into ``c_attn``)."""
    state = {
        "transformer.wte.weight": ours["decoder.embedding.tokens.weight"],
        "transformer.wpe.weight": ours["decoder.position.weight"],
        "transformer.ln_f.weight": ours["decoder.final_norm.weight"],
        "lm_head.weight": ours["decoder.embedding.tokens.weight"],
    }
    for i in range(n_layers):
        layer, block = f"decoder.layers.{i}", f"transformer.h.{i}"
        attention = [ours[f"{layer}.attention.{p}_proj.weight"] for p in "qkv"]
        state.update(
            {
                f"{block}.ln_1.weight": ours[f"{layer}.attention_norm.weight"],
                f"{block}.attn.c_attn.weight": __import__("torch").cat(attention, dim=0),
                f"{block}.attn.c_proj.weight": ours[f"{layer}.attention.out_proj.weight"],
                f"{block}.ln_2.weight": ours[f"{layer}.ffn_norm.weight"],
                f"{block}.mlp.c_fc.weight": ours[f"{layer}.ffn.up_proj.weight"],
                f"{block}.mlp.c_proj.weight": ours[f"{layer}.ffn.down_proj.weight"],
            }
        )
    return state


def check_nanogpt_shaped(spec, recipe) -> None:
    """The recipe must describe nanoGPT's model for the comparison to mean anything."""
    d, attention, ffn, norm = spec.decoder, spec.decoder.attention, spec.decoder.ffn, spec.decoder.norm
    facts = {
        "decoder-only": spec.architecture == "decoder-only",
        "learned positions": spec.position.type == "learned",
        "tied head": spec.tie_embeddings,
        "GELU MLP of 4 x d_model": (ffn.type, ffn.activation) == ("mlp", "gelu")
        and ffn.resolved_hidden_dim(spec.d_model) == 4 * spec.d_model,
        "no biases": not (attention.qkv_bias or attention.out_bias or ffn.bias or norm.bias),
        "pre-LN LayerNorm": (norm.type, norm.placement) == ("layernorm", "pre"),
        "no dropout": attention.dropout == d.dropout == 0.0,
        "MHA": attention.n_kv_heads == attention.n_heads,
        "decayed embeddings": recipe.optimizer.decay_embeddings,
        "cosine schedule": recipe.schedule.type == "cosine",
    }
    wrong = [name for name, ok in facts.items() if not ok]
    if wrong:
        raise SystemExit(f"the recipe is not nanoGPT-shaped ({', '.join(wrong)}); the yardstick cannot mirror it")


def yardstick_worker(seed: int, max_steps: int | None, own_init: bool) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from yardstick import GPT, GPTConfig, LoopConfig, train

    from yamlformer.builder import build_model
    from yamlformer.recipes.data.windows import Mixture, TrainWindows, ValWindows
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.tasks.lm.training import open_run_corpus
    from yamlformer.recipes.training.resolved import resolve_run

    run = resolve_run(load_recipe(RECIPE, _overrides(seed, max_steps)), fetch=True)
    recipe, spec = run.recipe, run.spec
    t, d, opt, sched = recipe.trainer, recipe.data, recipe.optimizer, recipe.schedule
    corpus = open_run_corpus(run)
    check_nanogpt_shaped(spec, recipe)
    mixture = Mixture(corpus.sources, t.seed, spec.vocab_size)

    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            vocab_size=spec.vocab_size,
            block_size=spec.max_seq_len,
            n_layer=spec.decoder.n_layers,
            n_head=spec.decoder.attention.n_heads,
            n_embd=spec.d_model,
        )
    )
    if not own_init:  # the recipe's seeded init (yamlformer.recipes.training.run.training_model seeds the same way)
        torch.manual_seed(seed)
        ours = build_model(spec).state_dict()
        model.load_state_dict(nanogpt_state(ours, spec.decoder.n_layers))
    loop = LoopConfig(
        max_iters=t.max_steps,
        learning_rate=opt.lr,
        min_lr=sched.min_lr,
        warmup_iters=sched.warmup_steps,
        lr_decay_iters=sched.decay_steps or t.max_steps,
        weight_decay=opt.weight_decay,
        beta1=opt.betas[0],
        beta2=opt.betas[1],
        grad_clip=t.gradient_clip_val or 0.0,
        eval_interval=t.val_check_interval,
        log_interval=t.log_every_n_steps,
    )
    # the recipe's windows, each (x, y) made contiguous as nanoGPT's get_batch returns them
    batches = ((x.contiguous(), y.contiguous()) for x, y in TrainWindows(mixture, d.batch_size, 0, 1, 0))
    val = [(x.contiguous(), y.contiguous()) for x, y in ValWindows(mixture, d.batch_size, t.limit_val_batches, 0, 1)]
    result = train(
        model,
        batches,
        lambda: val,
        loop,
        on_eval=lambda step, loss, wall: print(f"  yardstick step {step}: val {loss:.4f} at {wall:.1f} s", flush=True),
    )
    tokens_per_step = d.batch_size * d.seq_len
    rates = sorted(n * tokens_per_step / s for n, s in result["intervals"])
    return {
        "val": result["val"],
        "tokens_per_s": rates[len(rates) // 2],
        "compile_seconds": 0.0,
        "wall_seconds": result["val"][-1][2],
    }


def recipe_worker(seed: int, max_steps: int | None, settings: list[str]) -> dict:
    import torch

    from yamlformer.builder.spec.loader import parse_set_args
    from yamlformer.recipes.training.run import run

    with tempfile.TemporaryDirectory(prefix="shakespeare-char-") as tmp:
        overrides = dict(
            _overrides(seed, max_steps), **parse_set_args(settings), **{"trainer.output_dir": str(Path(tmp) / "run")}
        )
        summary = run(RECIPE, overrides, fresh=True, samples=False)
        history = torch.load(summary["last"], map_location="cpu", weights_only=True)["builder"]["history"]
    return {
        "val": history["val"],
        "tokens_per_s": summary["tokens_per_s"],
        "compile_seconds": summary["compile_seconds"],
        "wall_seconds": history["val"][-1][2],
    }


# -- the side-by-side driver ------------------------------------------------------------------------


def run_worker(which: str, seed: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    command = [sys.executable, __file__, "--worker", which, "--seed", str(seed), "--result", str(out)]
    if args.max_steps is not None:
        command += ["--max-steps", str(args.max_steps)]
    if args.own_init:
        command.append("--own-init")
    if args.threads:
        command += ["--threads", str(args.threads)]
    for setting in args.set:
        command += ["--set", setting]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"the {which} run (seed {seed}) failed:\n{done.stdout[-4000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    result["process_seconds"] = time.perf_counter() - started
    return result


def seconds_to(val: list, target: float) -> float | None:
    """Wall seconds at the first validation at or below ``target`` (None: never reached)."""
    return next((wall for _, loss, wall in val if loss <= target), None)


def median_or_none(values: list) -> float | None:
    """The median, a run that never got there counting as slower than every one that did."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    return ordered[len(ordered) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 7, 42])
    parser.add_argument("--max-steps", type=int, help="shorter runs for development (default: the recipe's 2000)")
    parser.add_argument("--own-init", action="store_true", help="the yardstick draws its own initial weights")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads in both (default: torch's, one per core); 1 "
        "gives steadier ratios on a machine other work shares",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe field for the recipe's runs (as builder train --set)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=["yardstick", "recipe"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.worker == "yardstick":
            result = yardstick_worker(args.seed, args.max_steps, args.own_init)
        else:
            result = recipe_worker(args.seed, args.max_steps, args.set)
        Path(args.result).write_text(json.dumps(result))
        return 0

    print(
        f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}; started {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"yardstick": [], "recipe": []}
    for i, seed in enumerate(args.seeds):
        for which in ("yardstick", "recipe") if i % 2 == 0 else ("recipe", "yardstick"):
            result = run_worker(which, seed, args)
            result["seed"] = seed
            runs[which].append(result)
            print(
                f"seed {seed:5d} {which:9s}: val {result['val'][-1][1]:.4f}, {result['tokens_per_s']:8,.0f} tokens/s, "
                f"{result['wall_seconds']:6.1f} s training (compile {result['compile_seconds']:.1f} s)",
                flush=True,
            )

    target = statistics.median(r["val"][-1][1] for r in runs["yardstick"])
    for which in runs:
        for r in runs[which]:
            r["seconds_to_target"] = seconds_to(r["val"], target)
    pairs = list(zip(runs["yardstick"], runs["recipe"]))
    speedups = [rec["tokens_per_s"] / yard["tokens_per_s"] for yard, rec in pairs]
    summary = {
        "machine": machine(),
        "target": target,
        "tokens_per_s_ratio": statistics.median(speedups),
        "tokens_per_s_ratios": speedups,
        "mean_final_val": {w: statistics.mean(r["val"][-1][1] for r in runs[w]) for w in runs},
        "median_tokens_per_s": {w: statistics.median(r["tokens_per_s"] for r in runs[w]) for w in runs},
        "median_wall_seconds": {w: statistics.median(r["wall_seconds"] for r in runs[w]) for w in runs},
        "median_seconds_to_target": {w: median_or_none([r["seconds_to_target"] for r in runs[w]]) for w in runs},
        "median_compile_seconds": statistics.median(r["compile_seconds"] for r in runs["recipe"]),
        "runs": runs,
    }
    to_target = summary["median_seconds_to_target"]
    summary["time_to_target_ratio"] = (
        to_target["yardstick"] / to_target["recipe"] if to_target["recipe"] and to_target["yardstick"] else None
    )
    summary["wall_ratio"] = summary["median_wall_seconds"]["yardstick"] / summary["median_wall_seconds"]["recipe"]

    print(f"\nside by side on {summary['machine']}; target = the yardstick's median final val loss {target:.4f}")
    print(
        f"{'':10s} {'final val (mean)':>16s} {'tokens/s (median)':>18s} {'run s (median)':>15s} "
        f"{'s to target (median)':>21s} {'compile s':>10s}"
    )
    for w in runs:
        reached = to_target[w]
        print(
            f"{w:10s} {summary['mean_final_val'][w]:16.4f} {summary['median_tokens_per_s'][w]:18,.0f} "
            f"{summary['median_wall_seconds'][w]:15.1f} {('%.1f' % reached) if reached else 'not reached':>21s} "
            f"{statistics.median(r['compile_seconds'] for r in runs[w]):10.1f}"
        )
    ratio = summary["time_to_target_ratio"]
    print(
        f"recipe / yardstick tokens/s: {summary['tokens_per_s_ratio']:.2f}x (per seed: "
        f"{', '.join(f'{s:.2f}' for s in speedups)}); whole run {summary['wall_ratio']:.2f}x faster; to target "
        f"{f'{ratio:.2f}x faster' if ratio else 'n/a'} (compile counted); final val loss "
        f"{summary['mean_final_val']['recipe'] - summary['mean_final_val']['yardstick']:+.4f} (recipe - yardstick)"
    )
    return emit(summary, args.json)


if __name__ == "__main__":
    sys.exit(main())
